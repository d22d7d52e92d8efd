"""vLLM has no Predicted Outputs: flyspec's middleware for vLLM's server refuses a request
that sends a prediction, and passes every other request on with its body intact."""

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from flyspec.integrations.vllm.predictions import RefusePredictions


async def echo(request: Request) -> JSONResponse:
    return JSONResponse({"received": (await request.body()).decode()})


def client() -> TestClient:
    app = Starlette(
        routes=[
            Route("/v1/chat/completions", echo, methods=["POST"]),
            Route("/v1/completions", echo, methods=["POST"]),
            Route("/v1/models", echo, methods=["GET", "POST"]),
        ]
    )
    app.add_middleware(RefusePredictions)
    return TestClient(app)


def test_a_request_with_a_prediction_gets_one_clear_error():
    with client() as http:
        for path in ("/v1/chat/completions", "/v1/completions"):
            response = http.post(
                path, json={"prompt": "x", "prediction": {"type": "content", "content": "y"}}
            )
            assert response.status_code == 400
            error = response.json()["error"]
            assert "vLLM has no Predicted Outputs" in error["message"]
            assert (error["param"], error["type"]) == ("prediction", "invalid_request_error")


def test_other_requests_pass_with_their_body():
    body = '{"prompt": "x", "prediction": null}'
    with client() as http:
        response = http.post("/v1/completions", content=body)
        assert response.status_code == 200 and response.json()["received"] == body
        assert http.post("/v1/chat/completions", content="not json").status_code == 200
        assert http.get("/v1/models").status_code == 200
        sent = '{"prediction": {"type": "content", "content": "y"}}'
        assert http.post("/v1/models", content=sent).json()["received"] == sent
