"""Which grammar engine constrains flyspec's structured outputs: llguidance or xgrammar,
measured on the default pair's tokenizer (Qwen2.5, 151,665 tokens) on the CPU.

    pip install llguidance xgrammar       # both, for the comparison
    python benchmarks/grammar_engines.py  # a table: coverage, compile, mask and block times

For each JSON schema of a set that covers the features clients send (OpenAI's strict
schemas as pydantic writes them, ``$ref``, ``anyOf``, patterns, formats, bounds), each engine:
compiles it (or refuses it: coverage); walks a valid answer token by token, computing the
mask before each token and checking that it allows the token; and then, as a speculative
round needs, computes the masks of a block of 8 draft tokens and the position after them,
and rolls back over them (checked: the masks after the rollback equal those before). Times
are medians over the walks, in microseconds.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from flyspec.models.default_pair import default_pair_paths  # noqa: E402
from flyspec.models.loading import load_tokenizer  # noqa: E402
from flyspec.support.machine import cpuinfo, git_commit  # noqa: E402

BLOCK = 8

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "languages": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "languages"],
    "additionalProperties": False,
}
SCHEMAS: dict[str, tuple[dict | None, object, str]] = {
    "json_object": (
        None,
        {"result": [1, 2.5, True, None], "note": "any JSON object"},
        '["an array, not an object"]',
    ),
    "strict (pydantic)": (
        PERSON,
        {"name": "Ada Lovelace", "age": 36, "languages": ["English", "French"]},
        '{"name": "Ada Lovelace", "age": 36.5, "languages": []}',
    ),
    "enum, pattern, bounds": (
        {
            "type": "object",
            "properties": {
                "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                "status": {"enum": ["open", "shipped", "closed"]},
                "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1},
            },
            "required": ["sku", "quantity", "status", "tags"],
            "additionalProperties": False,
        },
        {"sku": "ABC-1234", "quantity": 12, "status": "shipped", "tags": ["fragile"]},
        '{"sku": "ABC-1234", "quantity": 120, "status": "shipped", "tags": ["fragile"]}',
    ),
    "$ref, anyOf, nullable": (
        {
            "$defs": {
                "item": {
                    "type": "object",
                    "properties": {
                        "title": {"type": "string"},
                        "price": {"anyOf": [{"type": "number"}, {"type": "null"}]},
                    },
                    "required": ["title", "price"],
                    "additionalProperties": False,
                }
            },
            "type": "object",
            "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/item"}}},
            "required": ["items"],
            "additionalProperties": False,
        },
        {"items": [{"title": "pen", "price": 1.25}, {"title": "gift", "price": None}]},
        '{"items": [{"title": "pen", "price": "1.25"}]}',
    ),
    "recursive $ref": (
        {
            "$defs": {
                "node": {
                    "type": "object",
                    "properties": {
                        "value": {"type": "integer"},
                        "children": {"type": "array", "items": {"$ref": "#/$defs/node"}},
                    },
                    "required": ["value", "children"],
                    "additionalProperties": False,
                }
            },
            "$ref": "#/$defs/node",
        },
        {"value": 1, "children": [{"value": 2, "children": []}, {"value": 3, "children": []}]},
        '{"value": 1, "children": [{"value": 2}]}',
    ),
    "string length, format": (
        {
            "type": "object",
            "properties": {
                "code": {"type": "string", "minLength": 4, "maxLength": 8},
                "when": {"type": "string", "format": "date"},
                "email": {"type": "string", "format": "email"},
            },
            "required": ["code", "when", "email"],
            "additionalProperties": False,
        },
        {"code": "x9z2", "when": "2026-12-05", "email": "ada@example.com"},
        '{"code": "x9z2", "when": "2026-13-45", "email": "ada@example.com"}',
    ),
    "oneOf, const, exclusiveMinimum": (
        {
            "type": "object",
            "properties": {
                "shape": {
                    "oneOf": [
                        {
                            "type": "object",
                            "properties": {
                                "kind": {"const": "circle"},
                                "radius": {"type": "number", "exclusiveMinimum": 0},
                            },
                            "required": ["kind", "radius"],
                            "additionalProperties": False,
                        },
                        {
                            "type": "object",
                            "properties": {
                                "kind": {"const": "square"},
                                "side": {"type": "number", "exclusiveMinimum": 0},
                            },
                            "required": ["kind", "side"],
                            "additionalProperties": False,
                        },
                    ]
                }
            },
            "required": ["shape"],
            "additionalProperties": False,
        },
        {"shape": {"kind": "square", "side": 2}},
        '{"shape": {"kind": "square", "side": 0}}',
    ),
}


class LlguidanceEngine:
    name = "llguidance"

    def __init__(self, tokenizer) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg = llguidance
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer)
        self.vocab = self.tokenizer.vocab_size
        self.masks = llguidance.torch.allocate_token_bitmask(BLOCK + 1, self.vocab)
        self.executor = llguidance.LLExecutor()

    def compile(self, schema: dict | None):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(
            schema if schema is not None else {"type": "object"}
        )
        error = self.llg.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error and not error.startswith("WARNING"):
            raise ValueError(error)
        matcher = self.llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def mask(self, matcher, row: int = 0) -> torch.Tensor:
        self.llg.torch.fill_next_token_bitmask(matcher, self.masks, row)
        return self.masks[row]

    def consume(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)

    def block_masks(self, matcher, block: list[int]) -> torch.Tensor:
        """The masks before each of ``block`` and after it, the matcher left where it was:
        llguidance's own call for speculative decoding (consumes, masks, rolls back)."""
        self.llg.torch.fill_next_token_bitmask_par_with_draft_tokens(
            self.executor, [(matcher, 0, block)], self.masks
        )
        return self.masks[: len(block) + 1]


class XgrammarEngine:
    name = "xgrammar"

    def __init__(self, tokenizer) -> None:
        import xgrammar

        self.xgr = xgrammar
        self.info = xgrammar.TokenizerInfo.from_huggingface(tokenizer)
        self.compiler = xgrammar.GrammarCompiler(self.info)
        self.vocab = self.info.vocab_size
        self.masks = xgrammar.allocate_token_bitmask(BLOCK + 1, self.vocab)

    def compile(self, schema: dict | None):
        schema = schema if schema is not None else {"type": "object"}
        compiled = self.compiler.compile_json_schema(json.dumps(schema), strict_mode=True)
        return self.xgr.GrammarMatcher(compiled)

    def mask(self, matcher, row: int = 0) -> torch.Tensor:
        matcher.fill_next_token_bitmask(self.masks, row)
        return self.masks[row]

    def consume(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)

    def block_masks(self, matcher, block: list[int]) -> torch.Tensor:
        for row in range(len(block) + 1):
            self.mask(matcher, row)
            if row < len(block):
                matcher.accept_token(block[row])
        matcher.rollback(len(block))
        return self.masks[: len(block) + 1]


def allows(mask: torch.Tensor, token: int) -> bool:
    return bool((int(mask[token // 32]) >> (token % 32)) & 1)


def measure(engine, tokenizer, schema: dict | None, answer: object, invalid: str) -> dict:
    """One engine on one schema: compile time, per-token mask and consume times along the
    answer, the block masks with their rollback, and whether it refuses ``invalid`` (an
    answer that breaks one of the schema's constraints) before its end."""
    started = time.perf_counter()
    try:
        matcher = engine.compile(schema)
    except Exception as error:  # noqa: BLE001 - a refusal is what coverage counts
        return {"compiled": False, "error": str(error).splitlines()[0][:80]}
    compile_ms = (time.perf_counter() - started) * 1e3
    text = json.dumps(answer, indent=None)
    tokens = tokenizer.encode(text, add_special_tokens=False)
    mask_us, consume_us, allowed = [], [], True
    for token in tokens:
        started = time.perf_counter()
        mask = engine.mask(matcher)
        mask_us.append((time.perf_counter() - started) * 1e6)
        allowed &= allows(mask, token)
        started = time.perf_counter()
        allowed &= bool(engine.consume(matcher, token))
        consume_us.append((time.perf_counter() - started) * 1e6)
    ends_with_eos = allows(engine.mask(matcher), tokenizer.eos_token_id)
    # Blocks: from each position of the answer, the next BLOCK tokens, then rolled back.
    matcher = engine.compile(schema)
    block_us, rollback_ok = [], True
    for start in range(0, len(tokens) - BLOCK):
        block = tokens[start : start + BLOCK]
        started = time.perf_counter()
        masks = engine.block_masks(matcher, block).clone()
        block_us.append((time.perf_counter() - started) * 1e6)
        rollback_ok &= bool(torch.equal(engine.mask(matcher).clone(), masks[0]))
        engine.consume(matcher, tokens[start])
    matcher = engine.compile(schema)
    enforced = not all(
        allows(engine.mask(matcher), token) and engine.consume(matcher, token)
        for token in tokenizer.encode(invalid, add_special_tokens=False)
    ) or not allows(engine.mask(matcher), tokenizer.eos_token_id)
    return {
        "compiled": True,
        "enforced": enforced,
        "compile_ms": compile_ms,
        "tokens": len(tokens),
        "mask_us": statistics.median(mask_us),
        "consume_us": statistics.median(consume_us),
        "block_us": statistics.median(block_us) if block_us else float("nan"),
        "valid_walk": allowed and ends_with_eos,
        "rollback_ok": rollback_ok,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", default="llguidance,xgrammar")
    args = parser.parse_args()
    tokenizer = load_tokenizer(str(default_pair_paths().target))
    makers = {"llguidance": LlguidanceEngine, "xgrammar": XgrammarEngine}
    engines = [makers[name](tokenizer) for name in args.engines.split(",")]
    cpu = cpuinfo()
    name = cpu.get("model name", platform.machine())
    print(
        f"commit {git_commit(ROOT)}, CPU {name} "
        f"(family {cpu.get('cpu family')}, model {cpu.get('model')})"
    )
    print(f"torch threads {torch.get_num_threads()}, block of {BLOCK} draft tokens")
    print()
    print(
        "| schema | engine | compiles | compile ms | mask us/token | consume us/token "
        f"| block of {BLOCK}: masks + rollback, us | walk valid | rollback exact "
        "| refuses the invalid answer |"
    )
    print("|---|---|---|---:|---:|---:|---:|---|---|---|")
    for label, (schema, answer, invalid) in SCHEMAS.items():
        for engine in engines:
            row = measure(engine, tokenizer, schema, answer, invalid)
            if not row["compiled"]:
                print(f"| {label} | {engine.name} | no: {row['error']} | | | | | | | |")
                continue
            print(
                f"| {label} | {engine.name} | yes | {row['compile_ms']:.1f} | "
                f"{row['mask_us']:.0f} | {row['consume_us']:.0f} | {row['block_us']:.0f} | "
                f"{'yes' if row['valid_walk'] else 'NO'} | "
                f"{'yes' if row['rollback_ok'] else 'NO'} | "
                f"{'yes' if row['enforced'] else 'NO'} |"
            )


if __name__ == "__main__":
    main()
