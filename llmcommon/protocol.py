"""Metadata that the services exchange beyond the .proto messages."""

# The scheduler's first metadata on a Submit once it has queued the request: a stream that then
# breaks lost a request the scheduler held, and the gateway resubmits it (with the tokens already
# streamed) when the scheduler is back. A refusal ends the call without it.
ACCEPTED_KEY = "llmserve-accepted"
