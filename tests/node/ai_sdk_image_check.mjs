// Sends an image with the Vercel AI SDK's OpenAI provider, with its defaults: `openai(model)` (the
// Responses API: an input_image part) and `openai.chat(model)` (Chat Completions: an image_url part),
// both with the image as bytes (the provider sends a data: URL). Usage: node ai_sdk_image_check.mjs
// BASE_URL MODEL PNG_PATH. Prints one JSON object for tests/node/test_node_images.py.
import { readFileSync } from "node:fs";
import { createOpenAI } from "@ai-sdk/openai";
import { generateText, streamText } from "ai";

const [baseURL, model, pngPath] = process.argv.slice(2);
const openai = createOpenAI({ baseURL: `${baseURL}/v1`, apiKey: "unused" });
const image = readFileSync(pngPath);
const messages = [{ role: "user", content: [
  { type: "text", text: "What is in this picture?" },
  { type: "image", image, mediaType: "image/png" },
] }];
const settings = { maxOutputTokens: 8, temperature: 0, maxRetries: 0 };

const responses = await generateText({ model: openai(model), messages, ...settings });
const chat = await generateText({ model: openai.chat(model), messages, ...settings });
const errors = [];
const stream = streamText({ model: openai.chat(model), messages, ...settings, onError: ({ error }) => errors.push(String(error)) });
const deltas = [];
for await (const text of stream.textStream) deltas.push(text);

console.log(JSON.stringify({
  responses: { text: responses.text, usage: responses.usage, warnings: responses.warnings },
  chat: { text: chat.text, usage: chat.usage, warnings: chat.warnings },
  stream: { text: deltas.join(""), errors },
}));
