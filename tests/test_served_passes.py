"""benchmarks/served_passes.py: the ratios taken per pass and the answers compared with
llama-server's; and benchmarks/served.py's requests: the server's own time read from either
server's answer."""

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "served_passes.py"
_SPEC = importlib.util.spec_from_file_location("served_passes", _PATH)
served_passes = importlib.util.module_from_spec(_SPEC)
sys.modules[_SPEC.name] = served_passes  # dataclasses look their module up while it runs
_SPEC.loader.exec_module(served_passes)
served = sys.modules["served"]  # imported by served_passes, from benchmarks/
PassRun = served.PassRun


def test_the_ratio_is_taken_per_pass_and_answers_are_compared_with_llama_server_s():
    runs = {
        "llama-server": [PassRun(100, 10.0, 9.9, ["a", "b"]), PassRun(100, 8.0, 7.9, ["a", "b"])],
        "flyspec-target": [PassRun(110, 10.0, 9.0, ["a", "x"]), PassRun(90, 8.0, 7.2, ["a", "b"])],
    }
    lines = served_passes.table(runs).splitlines()
    row = next(line for line in lines if "--mode target" in line)
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    # 11.0 and 11.25 tok/s over 10.0 and 12.5: 1.100 and 0.900, median 1.00x
    assert cells[1] == "11.12 (11.00-11.25)"
    assert cells[2] == "1.00x (0.90-1.10)"
    assert cells[3] == "1.100, 0.900"
    assert cells[4] == "90.0%"
    assert cells[5] == "3/4"


def answer(extra: dict, *, tokens: int = 7, text: str = "done"):
    return SimpleNamespace(
        model_extra=extra,
        usage=SimpleNamespace(completion_tokens=tokens),
        choices=[SimpleNamespace(message=SimpleNamespace(content=text))],
    )


class Client:
    """Answers every chat request with ``reply``, and records what was sent."""

    def __init__(self, reply) -> None:
        self.sent = []

        def create(**request):
            self.sent.append(request)
            return reply

        self.chat = SimpleNamespace(completions=SimpleNamespace(create=create))


def test_the_server_s_own_time_comes_from_llama_server_s_timings_or_flyspec_s_statistics():
    llama = Client(answer({"timings": {"prompt_ms": 250.0, "predicted_ms": 1250.0}}))
    assert served.ask(llama, "m", [], max_tokens=4) == (7, 1.5, "done")
    assert "prediction" not in llama.sent[0]
    flyspec = Client(answer({"speculative": {"seconds": 2.25}}))
    assert served.ask(flyspec, "m", [], max_tokens=4, prediction="code") == (7, 2.25, "done")
    assert flyspec.sent[0]["prediction"] == {"type": "content", "content": "code"}
    assert flyspec.sent[0]["temperature"] == 0
