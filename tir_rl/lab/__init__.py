"""Research code the project ships: the written lab model and the SFT that trains it.

`model.py` writes MultiHop's policy into the weights of a three-layer Llama (the written lab
model, docs/lab_model.md); `sft.py` fine-tunes a model on an environment's oracle episodes
(`tir-rl sft`), which is how the trained lab model `lab-sft` is built. Neither is needed to
train a policy with RL; `tir_rl.models` prepares their checkpoints.
"""
