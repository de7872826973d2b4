"""The Kubernetes API as this project uses it, one job per module:

- `client`: the small HTTP client (`Session`, `ApiError`) and where its credentials come from;
- `connect`: a session (or a kubernetes_asyncio client) for a process that is starting;
- `preflight`: refuse to start without our CRDs;
- `retry`: a call again while the server answers 429;
- `custom`: one kind of custom object, with server-side apply as its only write verb;
- `watch`: the reader of watch streams;
- `cache`: the list+watch cache of one kind (the agent's and the operator's);
- `events`: core/v1 Events, posted in the background.

Kopf has its own client for watching; everything we write goes through here, so every
write is a server-side apply under a named field manager.
"""
