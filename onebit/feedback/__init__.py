"""What the optimizers and DiLoCo share: error-feedback 1-bit exchanges over
a process group, and everything those carry between calls.

- `ErrorFeedbackChannel` (channel.py): the one object each owner holds,
  with the backend, the exchange, the traffic, the telemetry, the restart
  notice and this rank's saved errors;
- `ErrorFeedbackExchange` (exchange.py): the fused buffers and their errors;
- `StepTelemetry` (telemetry.py): `comm_stats()`;
- the saved errors and the restart notice (state.py).

What the ranks must agree on (onebit/agreement.py) and the communication
thread's handoff (onebit/handoff.py) are not error feedback: they sit
beside this package. Nothing here imports `onebit.optim` or `onebit.diloco`.
"""
