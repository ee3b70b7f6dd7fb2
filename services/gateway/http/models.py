"""The model ids of the HTTP API: the served models' own (each pair's ModelInfo name, e.g.
"voxring-tiny"; pairs of two families serve two) and OpenAI's speech model ids, which clients
written for OpenAI's API send unchanged and which stand for the default model (the gateway's
``engines.default_model``, else the first one learned). ``POST /v1/audio/speech`` takes exactly
these in ``model``, ``GET /v1/models`` lists them and ``GET /v1/models/{id}`` answers for each;
any other id is 404 with OpenAI's ``model_not_found`` error naming ``model``.
"""

from __future__ import annotations

from starlette.responses import JSONResponse

from services.common.error_codes import MODEL_NOT_FOUND
from services.gateway.http.errors import error_response

OPENAI_MODELS = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts")
OWNER = "voxring"


def model_ids(served: list[str]) -> list[str]:
    """The ids this gateway accepts: the served models' (the default first), then OpenAI's."""
    return list(dict.fromkeys((*served, *OPENAI_MODELS)))


def model_json(model_id: str, served: list[str], families: dict[str, str] | None = None) -> dict:
    """OpenAI's model object; ``root`` names the model served under that id (as vLLM's do: an
    OpenAI id's is the default model, ``served[0]``), ``family`` that model's family."""
    root = model_id if model_id in served else served[0]
    obj = {"id": model_id, "object": "model", "created": 0, "owned_by": OWNER, "root": root}
    if families and root in families:
        obj["family"] = families[root]
    return obj


def models_json(served: list[str], families: dict[str, str] | None = None) -> dict:
    return {"object": "list", "data": [model_json(m, served, families) for m in model_ids(served)]}


def model_not_found(model: str, served: list[str]) -> JSONResponse:
    """OpenAI's answer to a model id it does not know: 404, code ``model_not_found``."""
    return error_response(404, f"model: {model!r} is not served here (model ids: "
                               f"{', '.join(model_ids(served))})", "model", MODEL_NOT_FOUND)
