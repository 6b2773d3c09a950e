"""Trainer side of KV-streams: attention masks that reproduce, at training time, exactly what the
inference engine saw after in-place eviction (token q attends to key k iff ``k <= q < death[k]``).
"""
