// An agent written against the official TypeScript SDK, using the gateway: the README's Node snippet.
// Run from a directory whose node_modules has @modelcontextprotocol/sdk: node gateway_client.mjs GATEWAY WORKFLOW
import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StreamableHTTPClientTransport } from "@modelcontextprotocol/sdk/client/streamableHttp.js";
import { z } from "zod";

const [gateway, workflow] = process.argv.slice(2);
const headers = { Authorization: `Bearer ${process.env.SAGA_GATEWAY_TOKEN}`, "Saga-Workflow": workflow };

async function connect(server) {
  const client = new Client({ name: "ts-agent", version: "1.0.0" });
  const url = new URL(`${gateway}/mcp/${server}`);
  await client.connect(new StreamableHTTPClientTransport(url, { requestInit: { headers } }));
  return client;
}

const [inventory, payments, shipping] = await Promise.all(["inventory", "payments", "shipping"].map(connect));
// listTools() validates against the SDK's schema and strips annotations.recovery: read the raw listing.
const raw = await payments.request({ method: "tools/list", params: {} }, z.object({}).passthrough());
const recovery = raw.tools.find((t) => t.name === "charge_payment").annotations.recovery;

const reserved = await inventory.callTool({ name: "reserve_inventory", arguments: { sku: "WIDGET-1", quantity: 2 } });
const charged = await payments.callTool({ name: "charge_payment", arguments: { orderId: workflow, amount: 19.5 } });
const shipped = await shipping.callTool({
  name: "create_shipment",
  arguments: { orderId: workflow, address: "1 Main St", simulateFailure: true },
});
let failSignalled = false;
if (shipped.isError) {
  const signal = await shipping.callTool({ name: "saga_fail", arguments: { reason: "shipment failed" } });
  failSignalled = !signal.isError;
}
await Promise.all([inventory, payments, shipping].map((c) => c.close()));
console.log(JSON.stringify({
  recovery,
  shipmentFailed: Boolean(shipped.isError),
  failSignalled,
  reservationId: reserved.structuredContent.reservationId,
  transactionId: charged.structuredContent.transactionId,
}));
