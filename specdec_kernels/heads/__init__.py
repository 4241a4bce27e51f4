"""Learned draft heads on the target's own hidden states and LM head (EAGLE, Medusa).

    EagleDrafter(target, head)      one decoder layer autoregressing on the target's features
    MedusaDrafter(target, heads)    K residual heads on the last hidden state
    train_draft_head(target, prompts, *, kind, out_dir, ...)   self-distillation training
    default_drafter(target)         the target's MTP layers or shipped/saved head, merged with n-gram
                                    and suffix-cache drafts (`heads.default`)
    head_drafter(target[, head])    that head alone (its EagleDrafter or MedusaDrafter)
    MtpDrafter(target, checkpoint_dir=None)   the target's own multi-token-prediction layers (`heads.mtp`)
    default_drafter(target, online=True), EagleDrafter(..., online=True)
                                    the head keeps learning while it serves (`heads.online`)
"""

from .default import default_drafter
from .drafters import EagleDrafter, HeadNgramDrafter, MedusaDrafter, find_head, head_drafter
from .mtp import MtpDrafter
from .online import OnlineLearner, OnlineOptions
from .train import train_draft_head

__all__ = ["EagleDrafter", "HeadNgramDrafter", "MedusaDrafter", "MtpDrafter", "OnlineLearner", "OnlineOptions", "default_drafter",
           "find_head", "head_drafter", "train_draft_head"]
