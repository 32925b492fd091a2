"""A streamed response's events: the chat completion's chunks (``event_stream.stream``) turned into
the Responses API's typed server-sent events, in OpenAI's order: ``response.created``, each output
item added, its deltas, its done events, then ``response.completed`` with the whole response.

One reasoning item, one message item and one item per function call, each opened by its first
delta and closed when the next kind starts or the choice finishes.
"""

from __future__ import annotations

import json

from fusedserve.coordinator.openai import responses_protocol as rp


class ResponseStream:
    def __init__(self, response_id: str, body: dict, model: str, created: int):
        self.id, self.body, self.model, self.created = response_id, body, model, created
        self.seq = 0
        self.items: list[dict] = []  # output items, completed as they close
        self.open: tuple[str, int, str] | None = None  # (kind, output index, accumulated text)
        self.calls: dict[int, int] = {}  # a chat tool call's index -> its output index
        self.finish_reason: str | None = None
        self.usage: dict | None = None
        self.response: dict | None = None  # set once completed

    def _event(self, kind: str, **fields: object) -> str:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

    def _snapshot(self, status: str) -> dict:
        return rp.response_object(self.id, self.body, self.model, list(self.items), status,
                                  self.usage, self.created, self.finish_reason)

    def start(self) -> list[str]:
        snap = self._snapshot("in_progress")
        return [self._event("response.created", response=snap),
                self._event("response.in_progress", response=snap)]

    def push(self, line: str) -> list[str]:
        """Events for one chat SSE line (``data: {...}``)."""
        data = line.removeprefix("data: ").strip()
        if data == "[DONE]":
            return self._complete()
        chunk = json.loads(data)
        if "error" in chunk:
            err = chunk["error"]
            return [self._event("error", code=err.get("code"), message=err.get("message"),
                                param=err.get("param"))]
        if chunk.get("usage") and not chunk.get("choices"):
            self.usage = chunk["usage"]
            return []
        out: list[str] = []
        for choice in chunk.get("choices", []):
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                out += self._text("reasoning", delta["reasoning_content"])
            if delta.get("content"):
                out += self._text("message", delta["content"])
            for call in delta.get("tool_calls") or []:
                out += self._call(call)
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]
                out += self._close()
                for index in list(self.calls):
                    out += self._close_call(index)
        return out

    def _text(self, kind: str, delta: str) -> list[str]:
        out: list[str] = []
        if self.open is None or self.open[0] != kind:
            out += self._close()
            index = len(self.items)
            if kind == "reasoning":
                item = {"type": "reasoning", "id": rp.new_id("rs"), "summary": [], "content": [],
                        "status": "in_progress"}
            else:
                item = rp.message_item("", status="in_progress")
            self.items.append(item)
            self.open = (kind, index, "")
            out.append(self._event("response.output_item.added", output_index=index, item=item))
            if kind == "message":
                out.append(self._event("response.content_part.added", item_id=item["id"], output_index=index,
                                       content_index=0, part=self._part("")))
        kind, index, text = self.open
        self.open = (kind, index, text + delta)
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        out.append(self._event(name, item_id=self.items[index]["id"], output_index=index, content_index=0,
                               delta=delta, **extra))
        return out

    @staticmethod
    def _part(text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        kind, index, text = self.open
        self.open = None
        item_id = self.items[index]["id"]
        if kind == "reasoning":
            self.items[index] = item = rp.reasoning_item(text, item_id)
            return [self._event("response.reasoning_text.done", item_id=item_id, output_index=index,
                                content_index=0, text=text),
                    self._event("response.output_item.done", output_index=index, item=item)]
        self.items[index] = item = rp.message_item(text, item_id)
        return [self._event("response.output_text.done", item_id=item_id, output_index=index, content_index=0,
                            text=text, logprobs=[]),
                self._event("response.content_part.done", item_id=item_id, output_index=index,
                            content_index=0, part=self._part(text)),
                self._event("response.output_item.done", output_index=index, item=item)]

    def _call(self, call: dict) -> list[str]:
        out: list[str] = []
        fn = call.get("function") or {}
        if call.get("id") is not None:  # a call's head: its id and name
            out += self._close()
            index = len(self.items)
            item = rp.call_item(call["id"], fn.get("name", ""), "", status="in_progress")
            self.items.append(item)
            self.calls[call["index"]] = index
            out.append(self._event("response.output_item.added", output_index=index, item=item))
        args = fn.get("arguments") or ""
        if args:
            index = self.calls[call["index"]]
            item = self.items[index]
            item["arguments"] += args
            out.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                   output_index=index, delta=args))
        return out

    def _close_call(self, call_index: int) -> list[str]:
        index = self.calls.pop(call_index)
        item = self.items[index]
        item["status"] = "completed"
        return [self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                            arguments=item["arguments"]),
                self._event("response.output_item.done", output_index=index, item=item)]

    def _complete(self) -> list[str]:
        out = self._close()
        for index in list(self.calls):
            out += self._close_call(index)
        self.response = self._snapshot("completed")
        kind = "response.incomplete" if self.response["status"] == "incomplete" else "response.completed"
        out.append(self._event(kind, response=self.response))
        return out
