"""absl entry points for training: `python -m train.generate_data`, then
`python -m train.train_drafter`."""
