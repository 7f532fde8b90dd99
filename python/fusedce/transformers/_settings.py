"""What apply() chose, for every module of the package to read at call time as
``_settings.<name>`` (apply() and revert() rebind them, so a name imported from here would keep
its value of the import)."""

original = None  # transformers' ForCausalLMLoss while applied
fused_linear = False  # apply(fused_linear=...)
metrics = False  # apply(metrics=...)
# apply()'s options of the fused linear loss, handed to every linear_cross_entropy call it makes
chunk_budget_bytes = "head"  # "head": the head weight's bytes (_head._chunk_budget)
low_memory = False
skip_ignored = False
