"""Model families, one package each (`higgs_v2/`, `higgs_v3/`), and the registry that chooses one by
config.json `model_type` (`registry.py`). What every family implements is engine/family.py."""
