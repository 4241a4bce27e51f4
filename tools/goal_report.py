"""Read the goal benchmarks' JSON (`specdec bench kernels --goal`: *_goal.json) and say, one line
per goal of issue 37, the measured ratio against its target: MET, MISSED, or n/a with the reason
(a peer that did not run, a row the time limit cut off). tools/gpu_session.sh appends these
lines to summary.txt after its bench:goal stage, so the first file read after a device call
already holds the numbers.

    python tools/goal_report.py RESULTS_DIR        # prints the lines; exit 0 (a missed goal is a result, not an error)

The goals (ratios against peers measured in the same run):
  tree attention, bf16, Hq=32 Hkv=8 D=128, T=64, prefix 8k, B=8: >= 5x SDPA with HF's dense mask,
      >= 1.3x FlexAttention with a BlockMask, >= 70% of the floor;
  verify, B=64, V=128k, chain k=4 and a 64-node tree, greedy and sampled: >= 10x a torch-native
      verify (torch_native for chains, the torch-ops reference for trees), within 1.5x of the
      bytes it must read (>= 67% of the floor);
  n-gram, B=256, L=32k: our CUDA kernel >= 10x torch `unfold` matching on the GPU, >= 100x the
      numba CPU scan.
Stdlib only (it runs wherever the JSON is, the GPU machine or here).
"""

import glob
import json
import os
import sys


def _load(folder: str, benchmark: str) -> list:
    """The rows of `<benchmark>_*goal*.json` files in folder (each row tagged with its device)."""
    rows = []
    for path in sorted(glob.glob(os.path.join(folder, f"{benchmark}_*goal*.json"))):
        with open(path) as f:
            result = json.load(f)
        for row in result.get("rows", []):
            rows.append(dict(row, _device=result.get("device", "?"), _complete=result.get("complete")))
    return rows


def _ratio_line(label: str, peer: str, peer_us, ours_us, target: float) -> str:
    if ours_us is None:
        return f"{label}: {peer}/ours n/a (ours did not run)"
    if peer_us is None:
        return f"{label}: {peer}/ours n/a ({peer} did not run)"
    ratio = peer_us / ours_us
    return f"{label}: {peer}/ours {ratio:.2f}x (goal >= {target:g}x) {'MET' if ratio >= target else 'MISSED'}"


def _floor_line(label: str, floor_us, ours_us, target: float) -> str:
    if ours_us is None or floor_us is None:
        return f"{label}: %floor n/a ({'ours' if ours_us is None else 'the floor'} was not measured)"
    share = floor_us / ours_us
    return f"{label}: {100 * share:.0f}% of the floor (goal >= {100 * target:.0f}%) {'MET' if share >= target else 'MISSED'}"


def goal_lines(folder: str) -> list:
    """The report's lines for the *_goal*.json files in folder (see the module docstring)."""
    lines = []
    for row in _load(folder, "tree_attention"):
        c = row["config"]
        label = f"goal tree_attention B={c['B']} T={c['T']} prefix={c['prefix']} ({row.get('ours_backend') or '-'})"
        ours, peers = row.get("ours_us"), row.get("peers_us", {})
        lines.append(_ratio_line(label, "sdpa_dense_mask", peers.get("sdpa_dense_mask"), ours, 5.0))
        lines.append(_ratio_line(label, "flex", peers.get("flex"), ours, 1.3))
        lines.append(_floor_line(label, row.get("floor_us"), ours, 0.70))
    for row in _load(folder, "verify"):
        c = row["config"]
        label = f"goal verify B={c['B']} {c['tree']} V={c['V']} {c['mode']} ({row.get('ours_backend') or '-'})"
        ours, peers = row.get("ours_us"), row.get("peers_us", {})
        peer = "torch_native" if "torch_native" in peers or c["tree"].startswith("chain") else "reference"
        lines.append(_ratio_line(label, peer, peers.get(peer), ours, 10.0))
        lines.append(_floor_line(label, row.get("floor_us"), ours, 1 / 1.5))
    for row in _load(folder, "ngram"):
        c = row["config"]
        label = f"goal ngram B={c['B']} L={c['L']} {c.get('workload', '')} (cuda; numba on {c.get('threads', '?')} threads)"
        ours, peers = row.get("ours_cuda_us"), row.get("peers_us", {})
        lines.append(_ratio_line(label, "unfold", peers.get("unfold"), ours, 10.0))
        lines.append(_ratio_line(label, "numba", peers.get("numba"), ours, 100.0))
    if not lines:
        lines.append(f"goal: no *_goal*.json rows in {folder}")
    return lines


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0].startswith("-"):
        print(__doc__)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    print("\n".join(goal_lines(argv[0])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
