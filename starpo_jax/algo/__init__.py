"""The update's maths, pure functions of arrays: trajectory scores to token rewards (``rewards``),
the StarPO-S group filter (``filtering``), advantage estimators (``advantages``), actor and critic
losses (``losses``), and the masked statistics they share (``masked``)."""
