"""HTTP routes, one module per SDK resource group (`service`, `training`, `weights`, `sampling`, `futures`)
plus `rest` (plain `/v1` JSON for non-SDK clients). `create_app` includes them in that order."""
