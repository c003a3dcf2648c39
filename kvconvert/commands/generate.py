"""`kvconvert generate`: run a prompt through the bundled paged runtime (kvconvert.runtime), streaming tokens."""

from __future__ import annotations

import json
import sys
import time

import click

from kvconvert import kvmath
from kvconvert.commands.options import click_options
from kvconvert.errors import KVConvertError
from kvconvert.runtime.options import GenerateOptions
from kvconvert.stage_options import build_options


@click.command("generate")
@click.option("--model", "model", required=True, help="HF model folder (or built-in name, e.g. smollm2-135m).")
@click.option("--prompt", default=None, help="Prompt text (no chat template is applied).")
@click.option("--prompt-file", type=click.Path(dir_okay=False, allow_dash=True), default=None,
              help="Read the prompt from a UTF-8 file ('-': standard input) instead of --prompt (long prompts).")
@click_options(GenerateOptions)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (text, token_ids, timing) instead.")
def generate_cmd(model, prompt, prompt_file, as_json, **params):
    """Generate text with the bundled paged-KV runtime (Llama and DeepSeek-V3 MLA checkpoints)."""
    from kvconvert.checkpoint import check_checkpoint
    from kvconvert.runtime import LLM, SamplingParams
    from kvconvert.sources import resolve_source

    opts = build_options(GenerateOptions, params)
    prompt = read_prompt(prompt, prompt_file)
    if not prompt:
        raise KVConvertError("empty prompt: give --prompt some text or a non-empty --prompt-file")
    sampling = SamplingParams(max_tokens=opts.max_new_tokens, greedy=opts.greedy, temperature=opts.temperature,
                              top_p=opts.top_p, seed=opts.seed)
    t0 = time.perf_counter()
    path = resolve_source(model)
    check_checkpoint(path)  # unsupported config, missing tensors, NaN/inf weights: refuse before generating
    kv_memory = None if opts.kv_memory is None else kvmath.parse_size(opts.kv_memory, bare_unit=1)
    llm = LLM(path, kv_dtype=opts.kv_dtype, kv_scales=opts.kv_scales, attention_backend=opts.backend,
              kv_memory=kv_memory, block_size=opts.block_size, max_num_seqs=1, dtype=opts.dtype, device=opts.device)
    tokenizer = llm.tokenizer
    load_s = time.perf_counter() - t0
    output = _run(llm, prompt, sampling, tokenizer, stream=not as_json)
    if output.error:
        raise KVConvertError(output.error)
    note = context_note(output, opts.max_new_tokens, llm.max_model_len)
    if note:
        click.echo(f"note: {note}", err=True)
    if as_json:
        click.echo(json.dumps({**_summary(llm, output, tokenizer, load_s), **({"note": note} if note else {})}))


def context_note(output, max_new_tokens: int, max_model_len: int) -> str | None:
    """Why a "length" finish came before --max-new-tokens: the context was full (finish_reason stays
    "length", as in vLLM; this says which length)."""
    n, prompt = len(output.token_ids), len(output.prompt_token_ids)
    if output.finish_reason != "length" or n >= max_new_tokens:
        return None
    return (f"the context ran out after {n} of --max-new-tokens {max_new_tokens} new tokens: the prompt's {prompt} "
            f"tokens + {n} fill the model's {max_model_len}-token context (max_model_len); shorten the prompt "
            "for longer answers")


def read_prompt(prompt: str | None, prompt_file: str | None) -> str:
    """The prompt from --prompt, or from --prompt-file (a path, '-' = standard input): a long
    prompt (hundreds of KB) does not fit in one command-line argument."""
    if (prompt is None) == (prompt_file is None):
        raise KVConvertError("give exactly one of --prompt TEXT or --prompt-file PATH ('-' reads standard input)")
    if prompt_file is None:
        return prompt
    try:
        if prompt_file == "-":
            return sys.stdin.read()
        with open(prompt_file, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError:
        raise KVConvertError(f"--prompt-file {prompt_file}: not UTF-8 text; save the prompt as UTF-8") from None
    except OSError as exc:
        raise KVConvertError(f"--prompt-file {prompt_file}: cannot read it ({exc.strerror})") from None


def _run(llm, prompt, params, tokenizer, stream: bool):
    """Run the request; when streaming, print text as tokens arrive. Returns the Output."""
    gen = llm.stream(prompt, params)
    tokens, printed = [], ""
    while True:
        try:
            token = next(gen)
        except StopIteration as stop:
            output = stop.value
            break
        tokens.append(token)
        if stream:
            text = tokenizer.decode(tokens, skip_special_tokens=True)
            if text.startswith(printed):  # print only what is new (multi-byte characters arrive whole)
                sys.stdout.write(text[len(printed):])
                sys.stdout.flush()
                printed = text
    if stream and output.error is None:
        sys.stdout.write("\n")
    return output


def _summary(llm, output, tokenizer, load_s: float) -> dict:
    ttft = output.time_to_first_token_s
    total = output.latency_s
    n = len(output.token_ids)
    decode_s = (total - ttft) if (total is not None and ttft is not None) else None
    return {
        "text": tokenizer.decode(output.token_ids, skip_special_tokens=True),
        "token_ids": output.token_ids,
        "finish_reason": output.finish_reason,
        "prompt_tokens": len(output.prompt_token_ids),
        "kv_dtype": llm.config.kv_dtype,
        "dtype": str(llm.dtype).removeprefix("torch."),
        "kv_bytes_per_token": llm.kv_bytes_per_token,
        "backend": llm.config.attention_backend,
        "device": str(llm.device),
        "timing": {
            "load_s": round(load_s, 4),
            "time_to_first_token_s": None if ttft is None else round(ttft, 4),
            "total_s": None if total is None else round(total, 4),
            "decode_tokens_per_s": round((n - 1) / decode_s, 3) if decode_s and n > 1 else None,
        },
    }
