"""The GPU fast paths behind the same objective as the reference step: the drafter step in
anchor chunks (fast_drafter.py) with its LM-head loss and kernels, the fast no-grad target
forwards, the worst-case memory probe, and the kernel-class profile. Each is checked against
trainer/model.py and trainer/loss.py on CPU."""
