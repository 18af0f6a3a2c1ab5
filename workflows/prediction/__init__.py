"""Prediction with a trained run: the request checked on the client (``prediction_request``,
``prediction_input``), batch inference as Dask tasks (``batch_predict``), and a classification's
confusion matrix (``confusion``)."""
