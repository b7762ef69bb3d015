#!/usr/bin/env node
// Stream a completion from a nanoserve scheduler, from Node.js.
// The stub is built at run time from protos/nanoserve/v1/generation.proto: nothing is generated.
//
//   node generate.js [--server HOST:PORT] [--max-tokens N] [--temperature T] [--json] PROMPT
//   node generate.js --token-ids 1,2,3 ...      (a token prompt, for servers without a tokenizer)
//   node generate.js --json-schema schema.json ...   (structured output: the text validates against it)
//   node generate.js --regex '[0-9]+' ...            (structured output: the text matches it in full)
//
// Text is written to stdout as it arrives; --json prints one object (text, token_ids,
// finish_reason, usage) instead. A gRPC error prints "error: CODE: message" and exits 1.
"use strict";

const fs = require("node:fs");
const path = require("node:path");
const { parseArgs } = require("node:util");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const PROTO = path.join(__dirname, "..", "..", "protos", "nanoserve", "v1", "generation.proto");

function loadStub(server) {
  const options = { keepCase: true, longs: Number, enums: String, defaults: true, oneofs: true };
  const definition = protoLoader.loadSync(PROTO, options);
  const { Generation } = grpc.loadPackageDefinition(definition).nanoserve.v1;
  return new Generation(server, grpc.credentials.createInsecure());
}

function buildRequest(values, prompt) {
  const request = {
    sampling: { temperature: Number(values.temperature) },
    stopping: { max_tokens: Number(values["max-tokens"]) },
  };
  if (values["json-schema"]) {
    request.structured_output = { json_schema: fs.readFileSync(values["json-schema"], "utf8") };
  } else if (values.regex) {
    request.structured_output = { regex: values.regex };
  }
  if (values["token-ids"]) {
    request.tokens = { token_ids: values["token-ids"].split(",").map(Number) };
  } else {
    request.text = prompt;
  }
  return request;
}

function main() {
  const { values, positionals } = parseArgs({
    allowPositionals: true,
    options: {
      server: { type: "string", default: process.env.NANOSERVE_SERVER || "127.0.0.1:50051" },
      "max-tokens": { type: "string", default: "64" },
      temperature: { type: "string", default: "0" },
      "token-ids": { type: "string" },
      "json-schema": { type: "string" },
      regex: { type: "string" },
      json: { type: "boolean", default: false },
    },
  });
  const client = loadStub(values.server);
  const completion = { text: "", token_ids: [], finish_reason: null, usage: null };
  const call = client.Generate(buildRequest(values, positionals.join(" ")));
  call.on("data", (chunk) => {
    completion.text += chunk.text;
    completion.token_ids.push(...chunk.token_ids);
    if (chunk.finish_reason !== "FINISH_REASON_UNSPECIFIED") {
      completion.finish_reason = chunk.finish_reason.replace("FINISH_REASON_", "").toLowerCase();
      completion.usage = chunk.usage;
    }
    if (!values.json) process.stdout.write(chunk.text);
  });
  call.on("error", (err) => {
    console.error(`error: ${grpc.status[err.code]}: ${err.details}`);
    process.exitCode = 1;
  });
  call.on("end", () => {
    process.stdout.write(values.json ? JSON.stringify(completion) + "\n" : "\n");
    client.close();
  });
}

main();
