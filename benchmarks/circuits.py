"""One attribution graph of a 30-token prompt on K2-nano with its shipped transcoders (``k2lab.circuits.attribute``):
its time at one thread and at all cores (medians of alternating rounds), its size before and after pruning, its
completeness error, and the intervention check (its top features zeroed in the real model against the graph's
prediction).

    python -m benchmarks.circuits [--rounds 3]
    python -m benchmarks.circuits --figure circuit.json   # also notebook 12's graph as plotly JSON (the docs' image)

The docs' PNG is that JSON drawn by kaleido 0.2.1, which needs plotly < 6 in a venv of its own (as
/work/shared/tools/render_figures.py explains): ``plotly.io.from_json(...).write_image("docs/assets/circuit_nano.png",
scale=2)``.
"""

from __future__ import annotations

import argparse
import statistics

import torch

import k2lab
from benchmarks.timing import alternate_threads
from k2lab import circuits

# 30 tokens of K2-nano's tokenizer; the graph explains the top prediction after them (`10`, copied from range(10)).
PROMPT = "for i in range(10):\n    if i % 2:\n        print(i)\n\nresult = [x * 2 for x in range("
TOKENS = 30
# Notebook 12's behaviour: which quote closes the string (logit of `",` minus that of `',`).
FIGURE_PROMPT, FIGURE_TARGET = 'x = ["a", "b', ('",', "',")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds at each thread count")
    parser.add_argument("--figure", help="also write notebook 12's graph, drawn by viz.circuit_figure, as plotly JSON")
    args = parser.parse_args()
    model, _ = k2lab.load_nano()
    transcoders = circuits.nano_transcoders()
    ids = model.to_tokens(PROMPT)[0, :TOKENS]
    if len(ids) != TOKENS:
        raise SystemExit(f"the prompt is {len(ids)} tokens, not {TOKENS}: the tokenizer changed; lengthen PROMPT")
    threads = sorted({1, torch.get_num_threads()})
    times = alternate_threads({"graph": lambda: circuits.attribute(model, transcoders, ids)}, threads, args.rounds)
    graph = circuits.attribute(model, transcoders, ids)
    s = graph.summary()
    print(f"prompt: {TOKENS} tokens; target {graph.target.label} = {graph.target.value:.3f}")
    for n in threads:
        t = times["graph", n]
        print(f"one graph at {n} thread{'s' if n > 1 else ''}: {statistics.median(t):.2f} s "
              f"(median of {len(t)}, range {min(t):.2f}-{max(t):.2f})")
    print(f"graph: {s['nodes']:,} nodes ({s['features']:,} features), {s['edges']:,} edges; kept after pruning "
          f"(node threshold {graph.node_threshold}, edge threshold {graph.edge_threshold}): {s['kept_nodes']} nodes "
          f"({s['kept_features']} features), {s['kept_edges']:,} edges; pruned {s['pruned_node_share']:.1%} of the "
          f"nodes and {s['pruned_edge_share']:.2%} of the edges")
    print(f"completeness: largest |incoming + bias - pre-activation| {s['completeness_error']:.2e} (largest "
          f"pre-activation {s['largest_pre_activation']:.2f}); router logits {s['router_completeness_error']:.2e}")
    with torch.no_grad():
        check = circuits.check_by_ablation(model, transcoders, graph, n=10)
    print(f"intervention: {check}")
    if args.figure:
        write_figure(model, transcoders, args.figure)


def write_figure(model, transcoders, path: str) -> None:
    """Notebook 12's graph with its features' top contexts in held-out text, as plotly JSON at ``path``."""
    from k2lab import viz
    from k2lab.training import corpus

    graph = circuits.attribute(model, transcoders, FIGURE_PROMPT, target=FIGURE_TARGET)
    texts = [doc.text for doc in corpus.documents("heldout")][:16]
    tops = circuits.top_activations(model, transcoders, graph, texts, max_len=256)
    with open(path, "w") as f:
        f.write(viz.circuit_figure(graph, tops).to_json())
    print(f"figure: {path} ({graph.summary()['kept_features']} features kept)")


if __name__ == "__main__":
    main()
