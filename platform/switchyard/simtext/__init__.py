"""The simulated engines' stand-in tokenizer and chat template.

Owns: ``tokens`` (a deterministic tokenizer with Llama 3's special tokens, and the text the
simulated model generates, each word one token) and ``chat`` (a Llama-3-style chat template:
messages, tools and media to token ids). Shared by the simulator, which serves with them, and the
gateway, which routes on them (a policy's ``tokenizer: switchyard-sim``), so that both turn a
request into the same token ids; the bench and the what-if replay size prompts with them.

Must not touch: any other switchyard package. A leaf: it imports only msgspec and the standard
library.
"""
