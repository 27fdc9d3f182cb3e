"""What a job learns about its input: step timing, job counters summed over DataLoader workers,
TensorBoard and Prometheus.
"""

__all__ = [
    "jobstats",
    "prometheus",
    "steptimer",
    "tensorboard",
]
