#!/usr/bin/env node
// Stream a generation from a nanoserve scheduler over vllm.grpc.engine.VllmEngine, the protocol gateways (the
// Shepherd Model Gateway, llm-d) speak to their workers, from Node.js. The stub is built at run time from
// vllm_engine.proto, which the PyPI package smg-grpc-proto ships in its proto/ folder:
//
//   PROTO_DIR=$(python -c 'import smg_grpc_proto, os; print(os.path.dirname(smg_grpc_proto.__file__) + "/proto")')
//   node vllm_engine.js --proto-dir "$PROTO_DIR" [--server HOST:PORT] [--max-tokens N] --token-ids 1,2,3
//   node vllm_engine.js --proto-dir "$PROTO_DIR" "Some text"
//
// Each streamed chunk's token ids go to stdout as they arrive, one line per chunk; the final GenerateComplete is
// printed as JSON on the last line. A gRPC error prints "error: CODE: message" and exits 1.
"use strict";

const path = require("node:path");
const { parseArgs } = require("node:util");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

function loadStub(protoDir, server) {
  const options = { keepCase: true, longs: Number, enums: String, defaults: true, oneofs: true,
                    includeDirs: [protoDir] };
  const definition = protoLoader.loadSync(path.join(protoDir, "vllm_engine.proto"), options);
  const { VllmEngine } = grpc.loadPackageDefinition(definition).vllm.grpc.engine;
  return new VllmEngine(server, grpc.credentials.createInsecure());
}

function buildRequest(values, prompt) {
  const request = {
    request_id: `node-${process.pid}`,
    stream: true,
    sampling_params: { temperature: 0, max_tokens: Number(values["max-tokens"]), ignore_eos: true },
  };
  if (values["token-ids"]) {
    request.tokenized = { input_ids: values["token-ids"].split(",").map(Number) };
  } else {
    request.text = prompt;
  }
  return request;
}

function main() {
  const { values, positionals } = parseArgs({
    allowPositionals: true,
    options: {
      "proto-dir": { type: "string" },
      server: { type: "string", default: process.env.NANOSERVE_SERVER || "127.0.0.1:50051" },
      "max-tokens": { type: "string", default: "16" },
      "token-ids": { type: "string" },
    },
  });
  if (!values["proto-dir"]) {
    console.error("error: --proto-dir is required (the proto/ folder of the smg-grpc-proto package)");
    process.exit(2);
  }
  const client = loadStub(values["proto-dir"], values.server);
  const call = client.Generate(buildRequest(values, positionals.join(" ")));
  call.on("data", (response) => {
    if (response.chunk) process.stdout.write(response.chunk.token_ids.join(",") + "\n");
    if (response.complete) process.stdout.write(JSON.stringify(response.complete) + "\n");
  });
  call.on("error", (err) => {
    console.error(`error: ${grpc.status[err.code]}: ${err.details}`);
    process.exitCode = 1;
  });
  call.on("end", () => client.close());
}

main();
