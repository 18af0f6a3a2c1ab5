"""What a job tells while it runs: the ranks' records relayed to the client once each, in order
(``events``); the training figures on the scheduler (``monitoring``) and its dashboard's Training
page (``dashboard``); MLflow and TensorBoard (``tracking``)."""
