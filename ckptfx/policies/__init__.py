"""Checkpoint policies: which intermediates a remat'd block keeps for its backward.

``ckptfx.policies`` is public: ``from ckptfx.policies import Offload`` and
``ckptfx.policies.save_only_these_names`` work, and pickles of policies name this module.
The mechanism, one idea per file (imports point down, in this order):

- ``tracer_stack.py``: the recorders active on this thread, the one fact ``checkpoint_name``
  and remat's recorder share;
- ``name_op.py``: the op ``ckptfx::checkpoint_name`` that carries a name into a compiled graph;
- ``names.py``: ``checkpoint_name``, and which names a forward used (``NameScope``);
- ``protocol.py``: what a policy is asked per op and what it may answer (``Policy``,
  ``Offload``, ``decide``, ``call_policy``);
- ``budget_policy.py``: ``memory_budget(fraction)``'s policy value (its planning is
  ``ckptfx.budget``'s);
- ``named.py``: JAX's named policies and factories, and the ``checkpoint_policies`` namespace;
- ``checks.py``: what ``remat`` checks and says about a policy (``UnusedNameWarning``);
- ``contexts.py``: what a ``checkpoint`` ``context_fn`` returns, checked, and torch's
  selective-checkpoint contexts guarded against cached values written after caching.

Rules:

1. **A policy is a value.** Named policies are frozen dataclasses (hashable, so caches key
   on them, and picklable); a torch selective-checkpoint policy function works wherever a
   policy does. Nothing in this package imports the kernel, a recorder or a front end.
2. **Pickles name this module.** Every policy class (and ``NameCheck``, which a
   ``checkpoint_wrapper``'d module holds) reports ``ckptfx.policies`` as its ``__module__``,
   set below, so a class can move between the files above without breaking a saved model.
3. **Bad input fails where it is written** (named.py Rule 1), and a name-based policy whose
   names a block never uses warns once (checks.py Rule 2).
"""

from ckptfx._public import report_home
from ckptfx.policies.budget_policy import MemoryBudget, memory_budget
from ckptfx.policies.checks import NameCheck, UnusedNameWarning
from ckptfx.policies.named import (
    DOTS,
    DotsSaveable,
    EverythingSaveable,
    NothingSaveable,
    OffloadDotWithNoBatchDims,
    SaveAndOffloadOnlyTheseNames,
    SaveAnyNamesButThese,
    SaveFromBothPolicies,
    SaveOnlyTheseNames,
    checkpoint_dots,
    checkpoint_policies,
    dots_saveable,
    dots_with_no_batch_dims_saveable,
    everything_saveable,
    nothing_saveable,
    offload_dot_with_no_batch_dims,
    save_and_offload_only_these_names,
    save_any_names_but_these,
    save_from_both_policies,
    save_only_these_names,
)
from ckptfx.policies.names import checkpoint_name
from ckptfx.policies.protocol import (
    MUST_SAVE,
    RECOMPUTE,
    SAVE,
    Decision,
    Offload,
    Policy,
    call_policy,
    decide,
)

# Back-compat: helpers this module held when ckptfx was one flat folder, for imports written
# then. New code imports them from their homes (checks.py, named.py, names.py, protocol.py).
from ckptfx.policies.checks import (
    describe_policy,
    is_policy_like,
    name_check,
    positional_policy_message,
    shared_name_check,
)
from ckptfx.policies.named import (
    _PolicyNamespace,  # checkpoint_policies's class: a pickled namespace names it here (Rule 2)
    check_policy,
    checkpoint_function_error,
    unpartial,
)
from ckptfx.policies.names import NameScope
from ckptfx.policies.protocol import referenced_names

__all__ = [
    "Offload",
    "Policy",
    "UnusedNameWarning",
    "checkpoint_name",
    "checkpoint_policies",
    "decide",
]

# Rule 2 (the namespace's class too: a pickled ``checkpoint_policies`` names it).
report_home(__name__, [
    Offload, Policy, DotsSaveable, EverythingSaveable, NothingSaveable, OffloadDotWithNoBatchDims,
    SaveAndOffloadOnlyTheseNames, SaveAnyNamesButThese, SaveFromBothPolicies, SaveOnlyTheseNames,
    NameCheck, UnusedNameWarning, _PolicyNamespace,
    # the factories too: a pickled ``checkpoint_policies`` holds them
    save_only_these_names, save_any_names_but_these, save_from_both_policies,
    save_and_offload_only_these_names, offload_dot_with_no_batch_dims])
