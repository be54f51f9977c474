"""The engine-side stop check, run after every appended token.

Stop strings are the frontend's business (they need detokenized text); here: min_tokens, EOS,
stop_token_ids, then the length caps, in that order, so an EOS sampled exactly at max_tokens
reports "stop".
"""

from __future__ import annotations

from stepahead.request import Request, RequestStatus


def check_stop(request: Request, max_request_len: int) -> bool:
    """Set the finished status (and stop_reason for a stop token) and return True if it stops.

    max_request_len is the most tokens a request may hold: max_model_len, or less where the KV
    pool is smaller.
    """
    params = request.sampling_params
    output = request.output_token_ids
    num_output = len(output)
    if num_output < params.min_tokens:
        # min_tokens cannot extend a request past the context window (that would wedge it).
        if request.num_tokens >= max_request_len:
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False
    last = output[-1]
    if (last == request.eos_token_id or last in request.extra_eos_token_ids) and not params.ignore_eos:
        request.status = RequestStatus.FINISHED_STOPPED
        return True
    if params.stop_token_ids and last in params.stop_token_ids:
        request.status = RequestStatus.FINISHED_STOPPED
        request.stop_reason = last
        return True
    if num_output >= request.max_tokens or request.num_tokens >= max_request_len:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False
