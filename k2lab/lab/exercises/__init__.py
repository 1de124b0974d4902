"""Check functions for the notebooks' "write it yourself" exercises.

Each ``check_*`` runs the learner's function on fixed inputs, compares the result with k2lab's own module (or the
formula k2lab implements), and returns a ``Verdict``: ``✓ ...`` when it agrees, otherwise ``✗`` and WHAT is wrong
(wrong shape, wrong scale, the eps forgotten, the bias in the weights, ...). The common mistakes are recognised by
computing them too: if the learner's output equals a known mistake's, the verdict names it. The inputs are chosen so
that the mistakes give different answers (ranks where the highest-first and lowest-first rules disagree, streams
whose rms makes eps matter, loads whose mean and median differ), and where an exercise forbids a computation
(the absorbed forms build no per-head key) a ``Watch`` sees every tensor the learner's code makes.

    from k2lab.lab import exercises
    exercises.check_rms_norm(my_rms_norm)      # ✓ or ✗ with the reason

A stub that still raises ``NotImplementedError`` gets "not written yet", so a notebook with unsolved exercises
still runs from top to bottom; library warnings raised inside a check stay out of the cell. The learner's function
runs under guard (``checking.call``): it is stopped after a minute (``time_limit(seconds)`` gives more), torch's
global settings it changes are put back and said, an argument it changes in place fails the check, and calling
k2lab's own implementation of the piece is named. A verdict prints its ✓ in green and its ✗ in red.

The construction track, each piece checked against k2lab and then used by the next, and the other exercises:

    check_greedy                00   greedy decoding
    check_group_router          04a  DeepSeek-V3's group-limited choice of experts
    check_dequantize            08   FP8 e4m3 with 128 x 128 block scales, as numbers
    check_release_state_dict    08   the release's tensors as K2Model's state dict
    check_cached_mla            09   MLA over your own latent cache, at a position offset
    check_cached_generate       09   greedy generation through your cache, against k2lab.generate
    check_next_token_loss       10   the next-token loss, pads ignored
    check_adamw_step            10   AdamW's step
    check_muon_step             10   Muon's step (momentum, Nesterov, RMS matching, decay)
    check_train_step            10   K2's recipe as one step of your own model
    compare_runs                10   your run beside k2lab's recipe_step
    check_bpe_training          01   learn BPE merges from a corpus (bytes, pre-tokens, most frequent pair)
    check_bpe                   01   encode with ranks (rank-BPE)
    check_rotation              02   the rotary rotation
    check_yarn_frequencies      02   YaRN's inverse frequencies and softmax scale, for K2 and DeepSeek-V3
    check_kv_cache_bytes        03   the latent cache's bytes
    check_mla_forward           03   MLA from its weights, naive or absorbed
    check_absorbed_score        03   the scores through the latent
    check_router                04a  the router's five stages
    check_rms_norm ... block    04b  RMSNorm, SwiGLU, the MoE's sum, the block
    check_max_violation         05   MaxVio, the load balance measure
    check_logit_attribution     06   one term's direct logit attribution
    check_patch_hook            07   a patching hook
    check_moe_block_parameters  08   one MoE block's parameters
    check_model_from_weights    09   the whole K2 from its state dict
    check_logit_lens            09   the logit lens
    check_newton_schulz         10   Muon's orthogonalisation
    check_qk_clip               10   QK-Clip for one MLA head
    check_bias_update           10   aux-loss-free balancing
    check_router_read           12   a feature's direct read by the router, W_gate (g * W_dec)
    check_influence             12   a node's influence on the target through the graph
    check_feature_purity        11   a feature's purity against the routing
    check_mutual_information    11   I(A; C) of two yes/no variables, in bits
"""

from .analysis import (
    check_kv_cache_bytes,
    check_logit_attribution,
    check_logit_lens,
    check_max_violation,
    check_moe_block_parameters,
    check_patch_hook,
)
from .attention import check_absorbed_score, check_mla_forward
from .blocks import check_block, check_moe_combine, check_rms_norm, check_router, check_swiglu
from .checking import Verdict, Watch, time_limit
from .circuits import check_influence, check_router_read
from .decode import check_cached_generate, check_cached_mla
from .features import check_feature_purity, check_mutual_information
from .groups import check_group_router
from .loading import check_dequantize, check_release_state_dict
from .model import check_greedy, check_model_from_weights, small_k2
from .own_training import check_adamw_step, check_muon_step, check_next_token_loss, check_train_step, compare_runs
from .position import DEEPSEEK_V3_ROPE, check_rotation, check_yarn_frequencies
from .tokens import check_bpe, check_bpe_training, train_bpe
from .training import check_bias_update, check_newton_schulz, check_qk_clip

__all__ = [
    "DEEPSEEK_V3_ROPE", "Verdict", "Watch", "check_absorbed_score", "check_bias_update", "check_block", "check_bpe",
    "check_bpe_training", "check_feature_purity", "check_greedy", "check_kv_cache_bytes", "check_logit_attribution",
    "check_logit_lens", "check_max_violation", "check_mla_forward", "check_model_from_weights", "check_moe_combine",
    "check_moe_block_parameters", "check_mutual_information", "check_newton_schulz", "check_patch_hook",
    "check_qk_clip", "check_rms_norm", "check_rotation", "check_router", "check_swiglu", "check_yarn_frequencies",
    "small_k2", "time_limit", "train_bpe",
]
__all__ += [
    "check_adamw_step", "check_cached_generate", "check_cached_mla", "check_dequantize", "check_group_router",
    "check_muon_step", "check_next_token_loss", "check_release_state_dict", "check_train_step", "compare_runs",
    "check_influence", "check_router_read",
]
