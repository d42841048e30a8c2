"""Metadata that the services exchange beyond the .proto messages."""

# The scheduler's first metadata on a Submit once it has queued the request: a stream that then
# breaks lost a request the scheduler held, and the gateway resubmits it (with the tokens already
# streamed) when the scheduler is back. A refusal ends the call without it.
ACCEPTED_KEY = "llmserve-accepted"

# With several cells (gateway --cells): the gateway's trailing metadata on a Generate call names
# the cell (its scheduler's address) that finished each choice and why it was routed there
# (match, load, round-robin, session, fallback), comma-separated in choice order; a client may
# send SESSION_KEY for the session router policy (a conversation id, a user).
CELL_KEY = "llmserve-cell"
ROUTE_KEY = "llmserve-route"
SESSION_KEY = "llmserve-session"
