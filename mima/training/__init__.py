"""MIMA training: the phase plan, the LightningModule, the synchronisation callback, `mima fit`."""
