"""Full-precision gradient averaging across replicas: the baseline every other algorithm beats on bytes."""
from __future__ import annotations


from .base import Algorithm, register
from .flat import flat_grads, set_flat_grads


@register
class AllReduce(Algorithm):
    """g <- mean over replicas of g: R replicas at batch B/R each step like one replica at batch B."""

    name = "allreduce"
    OPTIONS = ()
    WEIGHTS = True  # a mean of gradients (scaled to their shares first): unequal shares weigh exactly

    def after_backward(self) -> None:
        if self.comm.size > 1 and self.params:
            set_flat_grads(self.params, self.comm.allreduce_mean_(flat_grads(self.params)))
