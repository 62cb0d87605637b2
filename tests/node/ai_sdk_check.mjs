// Drives a running streamproxy's Responses API with the Vercel AI SDK's default OpenAI provider
// (`openai(model)` of @ai-sdk/openai is the Responses API; tests/node/package.json pins the versions).
// Usage: node ai_sdk_check.mjs BASE_URL MODEL. Prints one JSON object for tests/node/test_node_responses.py.
import { createOpenAI } from "@ai-sdk/openai";
import { generateText, streamText, tool } from "ai";
import { z } from "zod";

const [baseURL, model] = process.argv.slice(2);
const openai = createOpenAI({ baseURL: `${baseURL}/v1`, apiKey: "unused" });
const prompt = "Write a story about a dragon who learns to bake bread.";
const settings = { maxOutputTokens: 8, temperature: 0, maxRetries: 0 };

const gen = await generateText({ model: openai(model), prompt, ...settings });

const errors = [];
const stream = streamText({ model: openai(model), prompt, ...settings, onError: ({ error }) => errors.push(String(error)) });
const deltas = [];
for await (const text of stream.textStream) deltas.push(text);
const streamed = {
  text: deltas.join(""), deltas: deltas.length, finishReason: await stream.finishReason,
  usage: await stream.usage, errors,
};

const tools = { get_weather: tool({ description: "Get the weather of a city", inputSchema: z.object({ city: z.string() }) }) };
const ask = { model: openai(model), prompt: "What is the weather in Paris?", maxOutputTokens: 48, temperature: 0,
              maxRetries: 0, toolChoice: "required", tools, providerOptions: { openai: { parallelToolCalls: false } } };
const called = await generateText(ask);
const streamedCall = streamText({ ...ask, onError: ({ error }) => errors.push(String(error)) });
const parts = [];
for await (const part of streamedCall.fullStream) parts.push(part.type);
const streamedCalls = await streamedCall.toolCalls;

console.log(JSON.stringify({
  generate: { text: gen.text, finishReason: gen.finishReason, usage: gen.usage, id: gen.response.id, warnings: gen.warnings },
  stream: streamed,
  tool: { calls: called.toolCalls.map((c) => ({ name: c.toolName, input: c.input, id: c.toolCallId })),
          finishReason: called.finishReason },
  streamTool: { calls: streamedCalls.map((c) => ({ name: c.toolName, input: c.input, id: c.toolCallId })),
                finishReason: await streamedCall.finishReason, parts: [...new Set(parts)], errors },
}));
