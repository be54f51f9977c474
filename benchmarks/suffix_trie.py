"""Suffix decoding's trie, Python's against C++'s: indexing random prompts (the work a request's first
step pays with the suffix method) and the proposer's per-step time on one request.

    python benchmarks/suffix_trie.py --impl python   # then --impl cpp, each in a process of its own
        [--lengths 4096 32768] [--depth 24] [--vocab 32000]

Indexing: `--lengths` random token ids (uniform over `--vocab`, so nearly every substring is new: the
most nodes a prompt can make) into an empty trie of depth `--depth` in one extend call, as the proposer
indexes a prompt; the median of `--repeats` runs, each into a fresh trie. Memory: for Python's trie the
bytes tracemalloc sees allocated by the indexing (its nodes, dicts and lists), for C++'s the bytes its
vectors hold (tracemalloc does not see them); beside both, the growth of the process's resident set
(taken on the first trie of the run: a freed trie's pages stay with the allocator for the next).

Per step: one request with a `--prompt-len` random prompt whose output copies a stretch of the prompt
(so drafts hit and are accepted), `--steps` steps of SuffixProposer.draft_for after the first; each step
appends the accepted drafts and one more token. The first call (indexing the prompt) is shown apart.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
import tracemalloc

from stepahead.config import SpeculativeConfig
from stepahead.worker.spec_decode import cpu_suffix_trie
from stepahead.worker.spec_decode.suffix_proposer import SuffixProposer
from stepahead.worker.spec_decode.suffix_tree import SuffixIndex, SuffixTrie

IMPLEMENTATIONS = {"python": SuffixTrie, "cpp": cpu_suffix_trie.NativeSuffixTrie}


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


def index_once(make, tokens: list[int], depth: int, trace: bool) -> tuple[float, SuffixIndex, int, int]:
    """(ms, the trie, bytes tracemalloc saw allocated, RSS growth) of indexing `tokens` into a new trie."""
    gc.collect()
    rss = rss_bytes()
    if trace:
        tracemalloc.start()
    start = time.perf_counter()
    trie = make(depth)
    trie.extend([], tokens)
    elapsed = time.perf_counter() - start
    traced = tracemalloc.get_traced_memory()[0] if trace else 0
    if trace:
        tracemalloc.stop()
    return elapsed * 1e3, trie, traced, rss_bytes() - rss


def bench_indexing(name: str, length: int, depth: int, vocab: int, repeats: int) -> None:
    make = IMPLEMENTATIONS[name]
    rng = random.Random(length)
    tokens = [rng.randrange(vocab) for _ in range(length)]
    # RSS first (once a trie has been freed, the allocator keeps its pages for the next one), then
    # tracemalloc apart (its own records would count in the RSS).
    _, trie, _, rss = index_once(make, tokens, depth, trace=False)
    nodes = trie.num_nodes
    if isinstance(trie, cpu_suffix_trie.NativeSuffixTrie):
        held = trie.memory_bytes()
        del trie
    else:
        del trie
        _, trie, held, _ = index_once(make, tokens, depth, trace=True)
        del trie
    times = []
    for _ in range(repeats):
        ms, trie, _, _ = index_once(make, tokens, depth, trace=False)
        times.append(ms)
        del trie
    print(f"index  {name:6s} {length:6d} tokens depth {depth}: {statistics.median(times):8.1f} ms "
          f"(runs {', '.join(f'{t:.1f}' for t in times)}), {nodes} nodes, "
          f"{held / 2**20:6.1f} MiB held ({held / nodes:.0f} B/node), RSS +{rss / 2**20:.1f} MiB")


def bench_steps(name: str, prompt_len: int, steps: int, vocab: int, k: int) -> None:
    rng = random.Random(1)
    prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
    output = prompt[prompt_len // 4:prompt_len // 4 + steps * (k + 1)]  # a copy of part of the prompt
    proposer = SuffixProposer(SpeculativeConfig("suffix", k), max_model_len=prompt_len + len(output) + 1,
                              make_trie=IMPLEMENTATIONS[name])
    for i in range(16):  # finished requests in the shared trie, so each step matches there too
        proposer.cache_output(f"done{i}", [rng.randrange(vocab) for _ in range(512)])
    start = time.perf_counter()
    drafts = proposer.draft_for("r", prompt, 0)
    first = (time.perf_counter() - start) * 1e3
    produced, times, drafted = 0, [], 0
    while produced < len(output) and len(times) < steps:
        accepted = 0  # drafts accepted while they equal the output, as verification does
        while accepted < len(drafts) and drafts[accepted] == output[produced + accepted]:
            accepted += 1
        produced += accepted + 1
        start = time.perf_counter()
        drafts = proposer.draft_for("r", prompt + output[:produced], 0)
        times.append((time.perf_counter() - start) * 1e6)
        drafted += len(drafts)
    print(f"propose {name:6s} prompt {prompt_len}: first call {first:.1f} ms; per step median "
          f"{statistics.median(times):.1f} us over {len(times)} steps ({drafted / len(times):.2f} drafts a step)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--impl", nargs="+", default=["python", "cpp"], choices=list(IMPLEMENTATIONS),
                        help="which tries (one per process for RSS figures that mean something)")
    parser.add_argument("--lengths", nargs="+", type=int, default=[4096, 32768])
    parser.add_argument("--depth", type=int, default=24)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("-k", type=int, default=4, help="num_speculative_tokens")
    args = parser.parse_args()
    if "cpp" in args.impl and not cpu_suffix_trie.available():
        raise SystemExit("the C++ trie needs stepahead's CPU kernels, which are not built here (see the log)")
    for name in args.impl:
        for length in args.lengths:
            bench_indexing(name, length, args.depth, args.vocab, args.repeats)
        bench_steps(name, args.prompt_len, args.steps, args.vocab, args.k)


if __name__ == "__main__":
    main()
