"""The training path: passes, their pipeline, translated mini-batches and the fused step.

- :class:`PassRunner` (:mod:`._passes`): plans a pass (groups that fit the device budget), loads
  its working set into the device tier, writes it back;
- :class:`PassPipeline` (:mod:`._pipeline`): while pass N trains, pass N+1 is read ahead and
  pass N-1 written back, on one background worker;
- :mod:`._batchplan`: a pass's mini-batches translated ahead into device-tier slots;
- :class:`SparseTrainer` (:mod:`._trainer`): the gathers of a forward and the fused optimizer step.

Where each pass's rows came from is counted by :class:`hierps.tiers._stats.PassStats`.
"""
