"""The one exception class of the client and the stable error codes it carries."""

# Codes the server sends (docs/protocol.md, "Error codes").
BAD_REQUEST = "bad_request"
UNKNOWN_OPERATION = "unknown_operation"
TOO_LARGE = "too_large"
NOT_REGISTERED = "not_registered"
INVALID_BLOCKS = "invalid_blocks"
NOT_FOUND = "not_found"
OUT_OF_MEMORY = "out_of_memory"
TOO_MANY_NAMES = "too_many_names"
SHM_ERROR = "shm_error"
PROOF_REQUIRED = "proof_required"
INTERNAL = "internal"

SERVER_CODES = frozenset({
    BAD_REQUEST, UNKNOWN_OPERATION, TOO_LARGE, NOT_REGISTERED, INVALID_BLOCKS, NOT_FOUND,
    OUT_OF_MEMORY, TOO_MANY_NAMES, SHM_ERROR, PROOF_REQUIRED, INTERNAL,
})

# Client-side failures (the names liblmcache-client's lmc_status_name gives them).
TIMEOUT = "timeout"      # no reply within the timeout
TRANSPORT = "transport"  # ZMQ failed (send, receive, closed client)
PROTOCOL = "protocol"    # the reply is not a well-formed reply

CLIENT_CODES = frozenset({TIMEOUT, TRANSPORT, PROTOCOL})


class LmcacheError(Exception):
    """A failed request. `code` is the protocol's stable code (`not_found`, `invalid_blocks`, ...)
    or one of the client-side codes `timeout`, `transport`, `protocol`; `message` is the
    human-readable text; `op` the operation; `reply` the server's reply map (None for client-side
    failures); `result` the typed partial result when the server reported counts with the error
    (`retrieved_chunks` of a `not_found` retrieve, `stored_chunks` of an `out_of_memory` store),
    else None. A code the client does not know is kept as the server sent it."""

    def __init__(self, code, message, op=None, reply=None, result=None):
        super().__init__(f"{code}: {message}" if op is None else f"{op}: {code}: {message}")
        self.code = code
        self.message = message
        self.op = op
        self.reply = reply
        self.result = result

    @property
    def server_side(self):
        """True when the server sent the error (False for timeout/transport/protocol)."""
        return self.reply is not None
