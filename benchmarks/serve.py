"""`linrnn-serve bench serve`: a streaming load generator for any OpenAI-compatible server, with
vLLM `bench serve` definitions (BENCH.md "Serving benchmark"):

  TTFT  time from sending the request to the first streamed token
  TPOT  (E2E latency - TTFT) / (output tokens - 1), per request
  ITL   every gap between consecutive streamed chunks, pooled over requests
  E2EL  end-to-end request latency
  output tok/s = generated tokens / duration; total tok/s = (prompt + generated) / duration;
  request throughput = completed requests / duration. Mean, median and p99 of each latency.

Prompts are random token-id lists of a fixed length (the completions API accepts token ids; vLLM
and linrnn-serve both do), outputs a fixed length via max_tokens + ignore_eos, a fixed seed. Requests go
through a lean keep-alive HTTP/1.1 client (benchmarks/http_client.py): with 32+ streams in one event loop,
httpx's own per-chunk and per-send work delayed sends and token reads by ~10-45 ms, time that ended up in
the server's TTFT (benchmarks/results/serving/handover_cpu/).

`--workload multi-turn` (prefix caching): N users (`--num-users`, all at once) each hold a
conversation of T turns (`--num-turns`): a system prompt of S tokens shared by every user
(`--system-len`), then per turn U new user tokens (`--user-len`) appended, the request sent, and the
reply (`--output-len` tokens, read back as ids through vLLM's `return_tokens_as_token_ids`; random
ids if the server does not return them) appended before the next turn. Reported per turn: TTFT
median / mean and the prefix-cache hit rate (`usage.prompt_tokens_details.cached_tokens` / prompt
tokens); and the TTFT median over turns 2..T. The JSON keeps every request too (`requests`: turn, user,
request id, send time on CLOCK_MONOTONIC, TTFT s, E2EL s, prompt and cached tokens), to line up with a
server trace (`serve_probe server`, tools/prefix_timeline.py).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field

import httpx
import msgspec

from linrnn_bench.http_client import HTTPError, StreamClient

_json = msgspec.json  # the client's JSON: a 4k-id body encodes in a fraction of json.dumps' time


@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens
    output_ids: list[int] = field(default_factory=list)  # with return_tokens_as_token_ids + logprobs
    sent_at: float = 0.0  # time.perf_counter() at the send (CLOCK_MONOTONIC: comparable with a server's trace)
    request_id: str = ""  # the response's id (the server's request id)


async def send_request(client: StreamClient, model: str, prompt, max_tokens: int, api_key: str | None = None,
                       extra: dict | None = None, timeout: float = 600.0) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0.0,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    body.update(extra or {})
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    n_prompt = len(prompt) if isinstance(prompt, list) else 0
    res = RequestResult(ok=False, prompt_tokens=n_prompt)
    start = res.sent_at = time.perf_counter()
    last = start
    chunks = 0
    try:
        async with asyncio.timeout(timeout), client.post("/v1/completions", _json.encode(body), headers) as r:
            if r.status != 200:
                res.error = f"HTTP {r.status}: {(await r.read())[:300]!r}"
                return res
            async for line in r.lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":  # read on to the body's end: a response left unread closes its
                    continue  # connection, and the user's next turn would pay a new one
                msg = _json.decode(data)
                res.request_id = res.request_id or msg.get("id", "")
                if msg.get("usage"):
                    res.output_tokens = msg["usage"].get("completion_tokens", res.output_tokens)
                    res.prompt_tokens = msg["usage"].get("prompt_tokens", res.prompt_tokens)
                    res.cached_tokens = (msg["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                choices = msg.get("choices") or []
                for tok in ((choices[0].get("logprobs") or {}).get("tokens") or []) if choices else []:
                    if isinstance(tok, str) and tok.startswith("token_id:"):
                        res.output_ids.append(int(tok[9:]))
                # every choice chunk is a token event, text or not (as vLLM's bench serve): a token can
                # render as "" (an incomplete UTF-8 sequence, an id outside a small tokenizer's vocab)
                if not choices or choices[0].get("text") is None:
                    continue
                now = time.perf_counter()
                if chunks == 0:
                    res.ttft = now - start
                else:
                    res.itl.append(now - last)
                last = now
                chunks += 1
        res.latency = time.perf_counter() - start
        res.output_tokens = res.output_tokens or chunks
        res.ok = chunks > 0
        if not res.ok:
            res.error = "no tokens streamed"
    except (OSError, HTTPError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ValueError,
            msgspec.DecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


def _stats(values: list[float], scale: float = 1000.0) -> dict:
    if not values:
        return {"mean": float("nan"), "median": float("nan"), "p99": float("nan")}
    v = sorted(values)
    from linrnn_bench.kl_stats import percentile

    return {"mean": statistics.fmean(v) * scale, "median": statistics.median(v) * scale,
            "p99": percentile(v, 99.0) * scale}


def summarize(results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration, "input_tokens": in_tokens, "output_tokens": out_tokens,
        "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "ttft_ms": _stats([r.ttft for r in ok]), "tpot_ms": _stats(tpot),
        "itl_ms": _stats([g for r in ok for g in r.itl]), "e2el_ms": _stats([r.latency for r in ok]),
    }


def random_prompts(n: int, input_len: int, seed: int, id_range: tuple[int, int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(*id_range) for _ in range(input_len)] for _ in range(n)]


async def run_benchmark(base_url: str, model: str, prompts: list, output_len: int, max_concurrency: int,
                        request_rate: float = float("inf"), seed: int = 0, warmup_prompts: list = (),
                        api_key: str | None = None, timeout: float = 600.0) -> dict:
    async with StreamClient(base_url, max_connections=max_concurrency + 4) as client:
        # warm-up, not measured: also opens up to max_concurrency pooled connections
        warm = list(warmup_prompts)
        for i in range(0, len(warm), max_concurrency):
            await asyncio.gather(*(send_request(client, model, p, min(output_len, 4), api_key, timeout=timeout)
                                   for p in warm[i: i + max_concurrency]))
        sem = asyncio.Semaphore(max_concurrency)
        rng = random.Random(seed)

        async def one(p):
            async with sem:
                return await send_request(client, model, p, output_len, api_key, timeout=timeout)

        tasks = []
        start = time.perf_counter()
        for p in prompts:
            tasks.append(asyncio.create_task(one(p)))
            if request_rate != float("inf"):  # Poisson arrivals
                await asyncio.sleep(rng.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    out = summarize(results, duration)
    out.update(max_concurrency=max_concurrency, request_rate=request_rate, num_prompts=len(prompts),
               input_len=len(prompts[0]) if prompts and isinstance(prompts[0], list) else None,
               output_len=output_len)
    return out


async def run_multi_turn(base_url: str, model: str, num_users: int, num_turns: int, system_len: int,
                         user_len: int, output_len: int, seed: int = 0, id_range: tuple[int, int] = (100, 1000),
                         api_key: str | None = None, timeout: float = 600.0) -> dict:
    """Every user runs its turns back to back; all users at once (concurrency = num_users)."""
    rng = random.Random(seed)
    system = [rng.randrange(*id_range) for _ in range(system_len)]
    user_rngs = [random.Random(seed * 1000003 + u + 1) for u in range(num_users)]
    per_turn: list[list[RequestResult]] = [[] for _ in range(num_turns)]
    replies_as_ids = [True]
    records: list[list] = []  # per request: turn, user, request id, sent at (s, monotonic), TTFT s, E2EL s, prompt, cached
    extra = {"logprobs": 0, "return_tokens_as_token_ids": True}
    async with StreamClient(base_url, max_connections=num_users + 4) as client:
        # warm-up (not measured, shares nothing with the conversations)
        await send_request(client, model, [rng.randrange(*id_range) for _ in range(16)], 2, api_key, timeout=timeout)

        async def user(u: int) -> None:
            r_u, conv = user_rngs[u], list(system)
            for t in range(num_turns):
                conv += [r_u.randrange(*id_range) for _ in range(user_len)]
                r = await send_request(client, model, list(conv), output_len, api_key, extra, timeout)
                per_turn[t].append(r)
                records.append([t + 1, u, r.request_id, r.sent_at, r.ttft, r.latency, r.prompt_tokens,
                                r.cached_tokens])
                if not r.ok:
                    return
                if len(r.output_ids) != r.output_tokens:
                    replies_as_ids[0] = False
                    r.output_ids = [r_u.randrange(*id_range) for _ in range(r.output_tokens)]
                conv += r.output_ids

        start = time.perf_counter()
        await asyncio.gather(*(user(u) for u in range(num_users)))
        duration = time.perf_counter() - start
    turns = []
    for t, rs in enumerate(per_turn):
        ok = [r for r in rs if r.ok]
        prompt = sum(r.prompt_tokens for r in ok)
        turns.append({"turn": t + 1, "completed": len(ok), "failed": len(rs) - len(ok),
                      "prompt_tokens_mean": prompt / max(len(ok), 1), "ttft_ms": _stats([r.ttft for r in ok]),
                      "hit_rate": sum(r.cached_tokens for r in ok) / max(prompt, 1)})
    all_results = [r for rs in per_turn for r in rs]
    out = summarize(all_results, duration)
    later = [r for rs in per_turn[1:] for r in rs if r.ok]
    out.update(workload="multi-turn", num_users=num_users, num_turns=num_turns, system_len=system_len,
               user_len=user_len, output_len=output_len, max_concurrency=num_users, turns=turns,
               replies_as_ids=replies_as_ids[0], requests=records,
               ttft_ms_turns_2_plus=_stats([r.ttft for r in later]),
               hit_rate=sum(r.cached_tokens for r in all_results if r.ok) / max(out["input_tokens"], 1))
    return out


def format_turns(r: dict) -> str:
    lines = ["| turn | prompt tokens (mean) | TTFT median / mean ms | prefix-cache hit rate | failed |",
             "|---:|---:|---:|---:|---:|"]
    for t in r["turns"]:
        lines.append(f"| {t['turn']} | {t['prompt_tokens_mean']:.0f} | {t['ttft_ms']['median']:.1f} / "
                     f"{t['ttft_ms']['mean']:.1f} | {100 * t['hit_rate']:.1f} % | {t['failed']} |")
    x = r["ttft_ms_turns_2_plus"]
    lines.append(f"\nturns 2-{r['num_turns']}: TTFT median {x['median']:.1f} ms, mean {x['mean']:.1f} ms; "
                 f"hit rate {100 * r['hit_rate']:.1f} %; output {r['output_throughput']:.1f} tok/s"
                 + ("" if r["replies_as_ids"] else " (replies re-sent as random ids: the server returned no ids)"))
    return "\n".join(lines)


def format_table(rows: list[dict]) -> str:
    head = ("| concurrency | req/s | out tok/s | total tok/s | TTFT mean / p99 ms | TPOT mean / p99 ms | "
            "ITL median / p99 ms | E2EL mean ms | failed |")
    lines = [head, "|" + "---:|" * 9]
    for r in rows:
        lines.append(
            f"| {r['max_concurrency']} | {r['request_throughput']:.2f} | {r['output_throughput']:.1f} | "
            f"{r['total_token_throughput']:.1f} | {r['ttft_ms']['mean']:.1f} / {r['ttft_ms']['p99']:.1f} | "
            f"{r['tpot_ms']['mean']:.2f} / {r['tpot_ms']['p99']:.2f} | "
            f"{r['itl_ms']['median']:.2f} / {r['itl_ms']['p99']:.2f} | {r['e2el_ms']['mean']:.1f} | {r['failed']} |")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model name sent in requests (default: first of /v1/models)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=None, help="default: 4 x concurrency (at least 8)")
    p.add_argument("--max-concurrency", default="1,8,32,64", help="comma list: one run per value")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf = all at once")
    p.add_argument("--token-id-range", default="100,1000", help="random prompt token ids are drawn from [lo, hi)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=1, help="warm-up rounds of max_concurrency requests each")
    p.add_argument("--api-key", default=None)
    p.add_argument("--out", default=None, help="write results JSON here")
    m = p.add_argument_group("multi-turn / shared-prefix workload (--workload multi-turn)")
    m.add_argument("--workload", choices=("random", "multi-turn"), default="random")
    m.add_argument("--num-users", type=int, default=32, help="conversations run at once")
    m.add_argument("--num-turns", type=int, default=8)
    m.add_argument("--system-len", type=int, default=2048, help="shared system prompt tokens")
    m.add_argument("--user-len", type=int, default=128, help="new user tokens per turn (--output-len: reply)")


def run(args) -> int:
    base = args.base_url.rstrip("/")
    model = args.model
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    if model is None:
        try:
            r = httpx.get(base + "/v1/models", headers=headers, timeout=30)
            model = r.json()["data"][0]["id"]
        except httpx.HTTPError as e:
            raise SystemExit(f"bench serve: cannot reach {base}/v1/models: {e}") from None
        except (ValueError, KeyError, IndexError):
            raise SystemExit(f"bench serve: {base}/v1/models answered {r.status_code} without a model list "
                             f"(--api-key? --model?)") from None
    try:
        lo, hi = (int(x) for x in args.token_id_range.split(","))
        concurrencies = [int(c) for c in str(args.max_concurrency).split(",")]
    except ValueError:
        raise SystemExit(f"bench serve: --max-concurrency and --token-id-range take comma lists of integers, got "
                         f"{args.max_concurrency!r} and {args.token_id_range!r}") from None
    if min(concurrencies) < 1:
        raise SystemExit(f"bench serve: --max-concurrency values must be >= 1, got {args.max_concurrency!r}")
    if args.workload == "multi-turn":
        r = asyncio.run(run_multi_turn(base, model, args.num_users, args.num_turns, args.system_len, args.user_len,
                                       args.output_len, args.seed, (lo, hi), args.api_key))
        print(format_turns(r))
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"base_url": base, "model": model, "runs": [r], "args": vars(args)}, f, indent=1,
                          default=str)
        return 0 if r["failed"] == 0 else 1
    rows = []
    for conc in concurrencies:
        n = args.num_prompts or max(8, 4 * conc)
        n_warm = args.warmup * conc
        prompts = random_prompts(n + n_warm, args.input_len, args.seed, (lo, hi))
        r = asyncio.run(run_benchmark(base, model, prompts[n_warm:], args.output_len, conc,
                                      args.request_rate, args.seed, prompts[:n_warm], args.api_key))
        rows.append(r)
        print(format_table([r]).splitlines()[-1], flush=True)
    print(format_table(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"base_url": base, "model": model, "runs": rows, "args": vars(args)}, f, indent=1,
                      default=str)
    return 0 if all(r["failed"] == 0 for r in rows) else 1
