"""Loading models and tokenizers from folders, GGUF files and the offline HF cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flyspec.errors import FlyspecError
from flyspec.models import check_same_tokenizer, load_causal_lm, load_tokenizer, resolve_device
from flyspec.models.loading import looks_like_hub_id, resolve_dtype
from flyspec.models.pair import end_token_ids, load_pair
from tests.tiny import (
    make_tiny_model,
    make_tiny_tokenizer,
    save_tiny_gguf,
    save_tiny_pair,
)

CODE = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1)\n"


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return save_tiny_pair(tmp_path_factory.mktemp("pair"))


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    tokenizer = make_tiny_tokenizer()
    model = make_tiny_model(
        vocab_size=len(tokenizer),
        seed=7,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    path = save_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", model, tokenizer)
    return path, model


def _logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits


# --- the tiny helpers themselves -------------------------------------------------------------


def test_tiny_tokenizer_round_trips_and_has_eos_and_template() -> None:
    tokenizer = make_tiny_tokenizer(96)
    assert len(tokenizer) == 96
    ids = tokenizer.encode(CODE)
    assert tokenizer.decode(ids) == CODE
    assert "fibonacci" in tokenizer.convert_ids_to_tokens(ids)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id is not None
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert len(make_tiny_tokenizer(200)) == 200


def test_tiny_model_is_deterministic_by_seed() -> None:
    ids = make_tiny_tokenizer().encode(CODE)
    a = make_tiny_model(vocab_size=96, seed=3)
    b = make_tiny_model(vocab_size=96, seed=3)
    c = make_tiny_model(vocab_size=96, seed=4)
    assert not a.training
    assert torch.equal(_logits(a, ids), _logits(b, ids))
    assert not torch.equal(_logits(a, ids), _logits(c, ids))
    assert make_tiny_model(vocab_size=96, seed=3, dtype=torch.bfloat16).dtype == torch.bfloat16


# --- load_causal_lm / load_tokenizer ---------------------------------------------------------


def test_load_folder_round_trips_weights(pair: tuple[Path, Path]) -> None:
    draft_dir, target_dir = pair
    model = load_causal_lm(str(target_dir))
    assert not model.training
    assert model.config.num_hidden_layers == 2
    tokenizer = load_tokenizer(str(target_dir))
    assert len(tokenizer) == model.config.vocab_size == 96
    ids = tokenizer.encode(CODE)
    expected = make_tiny_model(vocab_size=96, seed=2, num_layers=2)
    assert torch.equal(_logits(model, ids), _logits(expected, ids))
    assert load_causal_lm(str(draft_dir)).config.num_hidden_layers == 1


def test_load_with_dtype(pair: tuple[Path, Path]) -> None:
    model = load_causal_lm(str(pair[0]), dtype=torch.bfloat16)
    assert next(model.parameters()).dtype == torch.bfloat16


def test_load_gguf_file(tiny_gguf: tuple[Path, torch.nn.Module]) -> None:
    path, original = tiny_gguf
    model = load_causal_lm(str(path))
    assert not model.training
    ids = [5, 9, 40, 77, 17]
    assert torch.allclose(_logits(model, ids), _logits(original, ids), atol=1e-6)
    # Dense after dequantisation and no longer marked quantised: it can be saved and cast.
    assert getattr(model, "hf_quantizer", None) is None
    assert not getattr(model.config, "quantization_config", None)
    tokenizer = load_tokenizer(str(path))
    assert len(tokenizer) == 96
    # A request ends at the end of a turn. Which token transformers names the tokenizer's EOS
    # varies with its version (5.17: <|endoftext|>, later <|im_end|>); the model's generation
    # config adds the GGUF's own end token either way.
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in end_token_ids(tokenizer, model)
    assert tokenizer.decode(tokenizer.encode(CODE)) == CODE


def test_gguf_model_can_be_saved_and_reloaded(
    tiny_gguf: tuple[Path, torch.nn.Module], tmp_path: Path
) -> None:
    path, original = tiny_gguf
    model = load_causal_lm(str(path))
    model.save_pretrained(tmp_path / "out")
    load_tokenizer(str(path)).save_pretrained(tmp_path / "out")
    reloaded = load_causal_lm(str(tmp_path / "out"))
    ids = [5, 9, 40, 77, 17]
    assert torch.allclose(_logits(reloaded, ids), _logits(original, ids), atol=1e-6)


def test_nonexistent_path_is_refused(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such-model"
    with pytest.raises(FlyspecError, match="model path does not exist"):
        load_causal_lm(str(missing))
    with pytest.raises(FlyspecError, match="model path does not exist"):
        load_tokenizer(str(missing))
    with pytest.raises(FlyspecError, match="model path does not exist"):
        load_causal_lm("./relative/missing.gguf")


def test_folder_without_config_is_refused(tmp_path: Path) -> None:
    (tmp_path / "weights.gguf").write_bytes(b"")
    with pytest.raises(FlyspecError, match="no config.json.*weights.gguf"):
        load_causal_lm(str(tmp_path))


def test_non_gguf_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "model.bin"
    path.write_bytes(b"\0")
    with pytest.raises(FlyspecError, match="not a .gguf file"):
        load_causal_lm(str(path))


def test_uncached_hub_id_is_refused_without_download(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FlyspecError, match="not found locally"):
        load_causal_lm("flyspec-test/definitely-not-cached")
    with pytest.raises(FlyspecError, match="not found locally"):
        load_tokenizer("flyspec-test/definitely-not-cached")


def test_hub_id_shape() -> None:
    assert looks_like_hub_id("Qwen/Qwen2.5-Coder-0.5B-Instruct")
    assert looks_like_hub_id("gpt2")
    assert not looks_like_hub_id("/abs/path")
    assert not looks_like_hub_id("a/b/c")
    assert not looks_like_hub_id("../up")
    assert not looks_like_hub_id("./x")
    assert not looks_like_hub_id("model.gguf")


def test_unknown_device_is_refused(pair: tuple[Path, Path]) -> None:
    with pytest.raises(FlyspecError, match="unknown device"):
        load_causal_lm(str(pair[0]), device="tpu")


# --- resolve_device --------------------------------------------------------------------------


def test_resolve_device(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_device("cpu") == "cpu"
    assert resolve_device(" CPU ") == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device(None) == "cpu"
    assert resolve_device("auto") == "cpu"
    with pytest.raises(FlyspecError, match="no CUDA GPU"):
        resolve_device("cuda")
    with pytest.raises(FlyspecError, match="unknown device"):
        resolve_device("gpu0")
    with pytest.raises(FlyspecError, match="none is available"):
        resolve_device("balanced")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_device("auto") == "cuda"
    assert resolve_device("balanced") == "balanced"
    assert resolve_device("cuda:0") == "cuda:0"
    with pytest.raises(FlyspecError, match="does not exist"):
        resolve_device("cuda:3")


def test_the_auto_dtype_is_bfloat16_on_cuda_and_float32_elsewhere(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_dtype("auto", "cpu") == resolve_dtype("auto", "auto") == torch.float32
    assert resolve_dtype("bfloat16", "cpu") == torch.bfloat16
    with pytest.raises(FlyspecError, match="dtype must be one of"):
        resolve_dtype("int4", "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    for device in ("auto", "cuda", "cuda:1", "balanced"):
        assert resolve_dtype("auto", device) == torch.bfloat16
    assert resolve_dtype("float32", "cuda") == torch.float32
    assert resolve_dtype("auto", "cpu") == torch.float32


# --- check_same_tokenizer --------------------------------------------------------------------


def test_identical_tokenizers_pass(pair: tuple[Path, Path]) -> None:
    draft, target = (load_tokenizer(str(p)) for p in pair)
    check_same_tokenizer(draft, target, draft_name="draft", target_name="target")


def test_different_vocab_sizes_are_refused() -> None:
    with pytest.raises(FlyspecError, match=r"96 vs 100 tokens, 4 entries differ"):
        check_same_tokenizer(
            make_tiny_tokenizer(96), make_tiny_tokenizer(100), draft_name="d", target_name="t"
        )


def test_same_size_different_tokens_are_refused() -> None:
    a = make_tiny_tokenizer(96, seed_words=("def", "return"))
    b = make_tiny_tokenizer(96, seed_words=("return", "def"))
    with pytest.raises(FlyspecError, match=r"'small' and target 'big' use different tokenizers"):
        check_same_tokenizer(a, b, draft_name="small", target_name="big")


def test_different_eos_is_refused() -> None:
    a = make_tiny_tokenizer(96)
    b = make_tiny_tokenizer(96)
    b.eos_token = "<|endoftext|>"
    with pytest.raises(FlyspecError, match="end-of-sequence"):
        check_same_tokenizer(a, b, draft_name="d", target_name="t")


def test_corrupt_weights_give_a_clear_error(pair: tuple[Path, Path], tmp_path: Path) -> None:
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(pair[0], broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(FlyspecError, match=f"could not load the model from {broken}"):
        load_causal_lm(str(broken))


def test_corrupt_gguf_gives_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(FlyspecError, match="could not load the model from .*bad.gguf"):
        load_causal_lm(str(path))


def test_a_pair_on_the_cpu_kernels_reads_its_vocabulary_and_says_what_runs_it(
    pair: tuple[Path, Path],
) -> None:
    """The kernels are applied before the models are wrapped: the packed and quantised output
    layers still give the logits' rows, and the logits are those of the plain target."""
    from flyspec.config import KernelConfig
    from flyspec.engine import Engine

    draft, target = pair
    loaded = load_pair(target=str(target), draft=str(draft))
    plain = load_pair(target=str(target), with_draft=False, kernels=KernelConfig.plain())
    rows = load_causal_lm(str(target)).config.vocab_size
    assert loaded.target.vocab_size == loaded.draft.vocab_size == plain.target.vocab_size == rows
    assert loaded.target_name == str(target) and loaded.draft_name == str(draft)
    assert loaded.kernels["draft_quant"] == "int8" and loaded.kernels["forward"] == "lean"
    assert set(loaded.kernels) >= {"draft_forward", "target_packed_layers", "draft_packed_layers"}
    assert plain.draft is None and plain.draft_name is None
    assert "draft_forward" not in plain.kernels and plain.kernels["linear"] == "default"
    assert loaded.cost_settings == {"dtype": "torch.float32", "device": "cpu"}
    prompt = [1, 5, 9, 4]
    torch.testing.assert_close(
        loaded.target.logits(prompt, 2), plain.target.logits(prompt, 2), atol=1e-4, rtol=1e-4
    )
    engine = Engine.from_pair(loaded)
    assert engine.kernels == loaded.kernels and engine.decoder.target is loaded.target
    assert engine.vocab_size == rows and engine.decoder.auto_k_store is not None


def test_an_unknown_backend_is_refused_before_loading() -> None:
    with pytest.raises(FlyspecError, match="backend must be one of"):
        load_pair(target="/nowhere", backend="onnx")
