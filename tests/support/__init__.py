"""Test support: what several test modules share (harness, snapshots, kernel cases, programs).

The float64 reference models, TVM's native cache and the state machine live in ``benchmarks/``
(``reference_model``, ``native_baseline``, ``state_machine_model``), which the tests may import.
"""
