"""Learning algorithms of the pod. Each module holds one algorithm's config, loss and update;
shared machinery (policies, normalisation) lives beside them. Algorithms are found by
registered name (entry-point group ``podium.algorithms``)."""
