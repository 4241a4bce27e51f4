"""`default_drafter(target)`: the best drafter the package has for a target, put together from
the drafters of `heads.mtp` (the target's own MTP layers), `heads.drafters` (trained EAGLE /
Medusa heads) and the loop's n-gram and suffix-cache drafters.
"""

from ..loop.drafters import Drafter, NgramDrafter, ScoredMergedDrafter, SuffixDrafter
from .drafters import HeadNgramDrafter, find_head, head_drafter
from .mtp import MtpDrafter, find_mtp
from .online import OnlineOptions


def default_drafter(target, *, online=False, head=None, suffix_cache=True) -> Drafter:
    """The best drafter this package has for `target`: the MTP layers of its own checkpoint
    (`MtpDrafter`; nothing to learn online), else its trained head (shipped in
    `specdec_kernels/heads/trained/`, or saved by the user under `<cache_dir>/heads/`, found
    by the target's identity), merged with the row's own context (n-gram drafts) and a suffix
    cache (`SuffixDrafter`: every prompt and output this drafter has seen, the batch's sibling
    rows included) into one tree, each node scored by the best of its sources; without MTP
    layers or a head, the n-gram drafts and the suffix cache alone.

    head: a head directory to use instead of looking one up (checked against `target`; the
    target's MTP layers are then not used): an EAGLE / Medusa head, or an MTP head trained by
    `train-draft --kind mtp` (drafted by `MtpDrafter`). Without one, a trained EAGLE / Medusa
    head found for the target comes before a trained MTP head.

    suffix_cache: True (default) adds the suffix cache; False leaves it out (the drafter
    of earlier versions). The cache belongs to the returned object: reuse the object across
    `generate` calls and later calls draft from earlier ones (a stream of requests, repeated
    tool calls); separately created `default_drafter(model)` objects share nothing, so a
    seed reproduces a call made with a fresh drafter, and no request's text reaches another's
    drafts unless the caller reuses the object. `drafter.suffix_cache` is the `SuffixDrafter`
    (None without one): `.add(token_lists)` feeds it texts, `.clear()` empties it.

    online: False (a frozen head), True (default settings) or a dict / `OnlineOptions` of
    settings (`heads.online`): the head keeps learning from the target's verified features
    while it serves, and the same drafter object reused across `generate` calls keeps what
    it learned (`drafter.online.stats`; `drafter.save(dir)` writes the adapted head, which
    `EagleDrafter(target, dir)` loads, and which `default_drafter` finds when dir is under
    `<cache_dir>/heads/`). Output stays exactly the target's either way. Without a trained head
    there is nothing to adapt: MTP layers stay as the checkpoint has them, n-gram and
    suffix-cache drafts are not learned, whatever `online` says."""
    options = OnlineOptions.coerce(online)  # bad settings fail here, head or not
    ngram = NgramDrafter(num_tokens=16)  # the planner verifies what pays of up to 16 (a long copy pays)
    suffix = SuffixDrafter() if suffix_cache else None
    context = ScoredMergedDrafter([ngram, suffix]) if suffix is not None else ngram
    if head is None and find_mtp(target) is not None:  # the model's own MTP layers come first
        drafter = HeadNgramDrafter(MtpDrafter(target), context)
    elif head is None and find_head(target) is None and find_head(target, "mtp") is not None:
        # a trained MTP head (`train-draft --kind mtp`) where the target has no EAGLE / Medusa head
        drafter = HeadNgramDrafter(MtpDrafter(target, find_head(target, "mtp")), context)
    elif head is not None and _kind(head) == "mtp":
        drafter = HeadNgramDrafter(MtpDrafter(target, head), context)
    else:
        folder = find_head(target) if head is None else head
        drafter = context if folder is None else HeadNgramDrafter(head_drafter(target, folder, online=options or False),
                                                                  context)
    drafter.suffix_cache = suffix
    return drafter


def _kind(folder) -> str:
    """The kind a head directory's config.json names (None when it has none)."""
    import json
    from pathlib import Path

    try:
        return json.loads((Path(folder) / "config.json").read_text()).get("kind")
    except (OSError, ValueError):
        return None
