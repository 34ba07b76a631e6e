"""posttrain's route in the vLLM server it starts (``--middleware``): ``/posttrain/registered?prefix=P``, how
many requests whose id starts with ``P`` the server has taken in (docs/algorithms.md)."""

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
