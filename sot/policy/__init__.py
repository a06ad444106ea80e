"""The commit policy: how much of each proposed tree to verify, per sequence and step.

Speculation pays only when the tokens a tree wins are worth more than the extra rows it costs
in the verify pass. The policy decides that per sequence, every step:

* **warm-up** - the first ``warmup`` tokens of a sequence are decoded plainly;
* **pruning by a cost model** - the tree's nodes are ranked by draft confidence (the
  cumulative draft probability of reaching them, scaled by a per-sequence calibration that
  tracks how often such nodes were really accepted); the policy keeps the best ``n`` nodes,
  where ``n`` maximises ``expected tokens / verify time(n + 1 rows)`` with verify time
  measured on this machine at start-up (:class:`CostModel`);
* **fallback** - when a sequence's measured speed (tokens per step over its draft time plus
  the modelled verify time of its rows) stays below ``fallback_threshold`` times plain
  decoding's over its last ``window`` steps, or clearly below it (under 80%) over 3 steps,
  it decodes plainly for a while, without drafting, and probes again on an exponential
  back-off (a probe that is clearly slow ends after one step). This is per sequence: the
  others keep speculating;
* **free drafts** - what the drafter offers without a model pass (prompt-lookup chains and
  suffix trees, :meth:`~sot.drafters.base.Drafter.propose_free`, :mod:`sot.drafters.free`) is
  verified on the steps its model is idle, and replaces drafting for a step when it promises
  more than the sequence's recent drafting steps measured (:meth:`CommitPolicy.prefers_free`);
  fallback then needs drafting to beat the free drafts' measured speed, not only plain
  decoding;
* **batches** - :meth:`CommitPolicy.worth_drafting` decides which sequences of a batch draft
  at all, and :mod:`sot.policy.guard` times whole steps per batch size and decodes plainly
  at a size where speculative steps commit fewer tokens per second than plain ones.

``learned`` replaces the calibrated draft confidence by an acceptance predictor
(:class:`AcceptanceModel`, a small MLP trained on logged decoding traces with
``sot train policy``): it predicts, per node, the probability that the target accepts it, from
the draft confidences, the node's depth and rank, and the sequence's recent acceptance. Pruning,
stopping (a root-only choice) and fallback then work as for ``heuristic``.

``rl`` keeps the heuristic's estimates, pruning candidates and fallback, but a small network
trained by reinforcement on simulated tokens per second (:mod:`sot.policy.rl`,
:mod:`sot.policy.simulate`, ``sot train policy --kind rl``) picks how many nodes to verify
and whether a sequence drafts or takes its free draft.

``static`` verifies a fixed-shape tree: the drafter's best ``width`` nodes at every depth up to
the predictor's depth (``1 + width * predictor_depth`` nodes), with no pruning and no fallback.
"""
from sot.policy.acceptance_model import (
    DEFAULT_ACCEPTANCE_MODEL, FEATURES, AcceptanceModel, Trace, fitting_acceptance_model, load_acceptance_model,
    node_features, resolve_policy,
)
from sot.policy.commit import CommitPolicy, StepOutcome, StepPlan
from sot.policy.config import PolicyConfig, PolicyKind
from sot.policy.cost import CostModel
from sot.policy.rl import DEFAULT_RL_POLICY, RLPolicyModel, load_rl_policy, resolve_rl_policy
from sot.policy.state import SequencePolicyState, prune, ranked_nodes

__all__ = [
    "DEFAULT_ACCEPTANCE_MODEL", "DEFAULT_RL_POLICY", "FEATURES", "AcceptanceModel", "CommitPolicy", "CostModel",
    "PolicyConfig", "PolicyKind", "RLPolicyModel", "SequencePolicyState", "StepOutcome", "StepPlan", "Trace",
    "fitting_acceptance_model", "load_acceptance_model", "load_rl_policy", "node_features", "prune", "ranked_nodes",
    "resolve_policy", "resolve_rl_policy",
]
