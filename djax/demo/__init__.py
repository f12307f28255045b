"""The small dLLM that ships with djax: its tokenizer, task, trainer and packaged weights."""
