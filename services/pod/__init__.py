"""The training pod: one agent (or a population) in training.

Split into the *worker* (batched env rollouts), the *learner* (updates) and the *evaluator*
(scores the agent). This is the only part of Podium that imports torch.
"""
