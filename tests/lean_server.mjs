// A TypeScript SDK 1.x server over streamable HTTP with sessions (the 2025-11-25 handshake): the lean call must
// carry the session id and protocol version the Python SDK negotiated. node lean_server.mjs PORT [json]
// A request for an unknown session gets a bare 404, as a restarted server's sessions are gone.
import http from "node:http";
import { randomUUID } from "node:crypto";
import { McpServer } from "@modelcontextprotocol/sdk/server/mcp.js";
import { StreamableHTTPServerTransport } from "@modelcontextprotocol/sdk/server/streamableHttp.js";
import { CreateMessageResultSchema, EmptyResultSchema, isInitializeRequest } from "@modelcontextprotocol/sdk/types.js";
import { z } from "zod";

const port = Number(process.argv[2]);
const json = process.argv[3] === "json";
const transports = {};

function build() {
  const server = new McpServer({ name: "lean-ts", version: "1.0.0" });
  server.tool("seen", {}, async (_args, extra) => ({
    content: [{ type: "text", text: JSON.stringify({ headers: extra.requestInfo?.headers ?? {}, meta: extra._meta ?? null }) }],
  }));
  server.tool("echo", { n: z.number() }, async ({ n }) => ({ content: [{ type: "text", text: String(n) }] }));
  // Asks the client two things in the middle of the call (on the call's SSE stream): a ping, then for a completion.
  server.tool("asks", {}, async (_args, extra) => {
    await extra.sendRequest({ method: "ping" }, EmptyResultSchema);
    let answer = "pinged; ";
    try {
      const message = { role: "user", content: { type: "text", text: "hi" } };
      await extra.sendRequest({ method: "sampling/createMessage", params: { messages: [message], maxTokens: 5 } }, CreateMessageResultSchema);
      answer += "sampled";
    } catch (error) {
      answer += `refused: ${error.code} ${error.message}`;
    }
    return { content: [{ type: "text", text: answer }] };
  });
  server.tool("forget", {}, async () => {
    for (const id of Object.keys(transports)) delete transports[id];
    return { content: [{ type: "text", text: "forgotten" }] };
  });
  return server;
}

http
  .createServer(async (req, res) => {
    const chunks = [];
    for await (const chunk of req) chunks.push(chunk);
    const body = chunks.length ? JSON.parse(Buffer.concat(chunks).toString()) : undefined;
    const sid = req.headers["mcp-session-id"];
    let transport = sid ? transports[sid] : undefined;
    if (!transport) {
      if (sid) {
        res.writeHead(404).end();
        return;
      }
      if (!(body && isInitializeRequest(body))) {
        res.writeHead(400, { "content-type": "application/json" });
        res.end(JSON.stringify({ jsonrpc: "2.0", error: { code: -32000, message: "Bad Request: No valid session ID provided" }, id: null }));
        return;
      }
      const fresh = new StreamableHTTPServerTransport({
        sessionIdGenerator: () => randomUUID(),
        enableJsonResponse: json,
        onsessioninitialized: (id) => {
          transports[id] = fresh;
        },
      });
      await build().connect(fresh);
      transport = fresh;
    }
    await transport.handleRequest(req, res, body);
  })
  .listen(port, "127.0.0.1");
