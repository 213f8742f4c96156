"""Algorithm cards: what the platform knows of each algorithm without importing torch.

One folder per built-in algorithm (``ppo/``, ``sac/``, ``td3/``, ``ddpg/``, ``dqn/``,
``portfolio_gradient/``) holds its card (``CARD`` in the folder's ``__init__``), its
hyperparameters (``config.py``, pydantic) and its presets (``presets/<env>.yaml``). Built-ins are
registered exactly as plugins are, under the entry-point group ``podium.algorithm_cards``
(pyproject.toml); the spec check, the pods and the CLI find a card by registered name
(``card.py``). What a family shares sits beside the folders (``offpolicy.py``); the checks every
reader applies are in ``hyperparameters.py``. The torch implementations are the pod's
(services/pod/algorithms/, registered under ``podium.algorithms``).
"""
