"""What posttrain adds to the vLLM server it starts (loaded in the server's API process through vLLM's
``--middleware``): one route, ``/posttrain/registered?prefix=P``, answering how many requests whose id starts
with ``P`` the server has taken in.

Each batch is drawn as one (``ServerBackend`` with ``whole_batches``): the client pauses the
scheduler (``/pause?mode=keep``), sends every request of the batch, and resumes it only once this route counts
them all. vLLM's API process registers a request and hands it to its engine in one stretch, with nothing awaited
between the two (vllm/v1/engine/async_llm.py ``_add_request``, for requests with ``n: 1``), and the resume
goes down the same ordered socket after them; so the engine holds the whole batch when it schedules its first
step, and orders it by each request's ``priority`` (the server runs with ``--scheduling-policy priority``), not
by when it arrived. A batch's steps are then the same on every run, and so are its samples.
"""

from __future__ import annotations

ROUTE = "/posttrain/registered"


async def registered(request, call_next):
    if request.url.path != ROUTE:
        return await call_next(request)
    from fastapi.responses import JSONResponse

    prefix = request.query_params.get("prefix", "")
    states = request.app.state.engine_client.output_processor.request_states
    count = sum(1 for state in list(states.values()) if state.external_req_id.startswith(prefix))
    return JSONResponse({"count": count})
