"""The orchestration: scan stages, records, run metadata, store tables, config, sharding,
Ray, the attribution stage. It drives the engine side and the training side.
"""
