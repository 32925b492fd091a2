"""Qwen3-Reranker's prompt: how a (query, document) pair is written for its yes/no judgement.

Its model card builds the prompt from three separately tokenized parts (a fixed system turn, the
instruction/query/document line, the assistant's empty think block), and the score is read at the
last of them. Sequence-classification conversions of it expect the same prompt.
"""

from __future__ import annotations

from fusedserve.coordinator.model_files.tokenizer import TextTokenizer

PREFIX = ('<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the '
          'Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n')
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


def pair_text(query: str, document: str, instruction: str | None = None) -> str:
    """The pair's own line, as the card formats it."""
    return f"<Instruct>: {instruction or DEFAULT_INSTRUCTION}\n<Query>: {query}\n<Document>: {document}"


def pair_ids(tokenizer: TextTokenizer, query: str, document: str,
             instruction: str | None = None) -> list[int]:
    """The pair's prompt ids: prefix, pair line and suffix each tokenized alone, as the card does."""
    return (tokenizer.encode(PREFIX) + tokenizer.encode(pair_text(query, document, instruction))
            + tokenizer.encode(SUFFIX))
