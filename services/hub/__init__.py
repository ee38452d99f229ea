"""Hub pushes: export a tenant's checkpoint (PEFT adapter + model card) to Hugging Face or ModelScope.

`service.HubPushService` is what the gateway calls (create/list pushes, store tokens); `runner.PushRunner`
does one attempt of a push (the Celery task of `carpool hub-worker`, or a thread of `carpool serve`);
`clients` holds the two hub clients at the `HfApi` / `HubApi` boundary; `credentials` encrypts tokens.
"""
