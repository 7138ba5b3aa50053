"""Named training configs: `python -m train.train_drafter --config=configs/<name>.py`."""
