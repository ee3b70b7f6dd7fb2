// A client of voxring.v1.Synthesizer written with nothing but @grpc/grpc-js and
// @grpc/proto-loader: the proto works outside Python.
// usage: node synthesize.js <protos dir> <target> <text> <seed>
// prints one JSON line: voices, audio bytes, frames, finish reason, chunk count.
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const [protos, target, text, seed] = process.argv.slice(2);
const definition = protoLoader.loadSync("voxring/v1/synthesizer.proto", {
  includeDirs: [protos], keepCase: true, longs: String, enums: String, defaults: true,
});
const voxring = grpc.loadPackageDefinition(definition).voxring.v1;
const client = new voxring.Synthesizer(target, grpc.credentials.createInsecure());
const deadline = () => new Date(Date.now() + 120000);

function fail(error) {
  console.log(JSON.stringify({ error: error.code, details: error.details }));
  process.exit(1);
}

client.ListVoices({}, { deadline: deadline() }, (error, voices) => {
  if (error) fail(error);
  client.Synthesize({ text, seed }, { deadline: deadline() }, (error2, whole) => {
    if (error2) fail(error2);
    const call = client.SynthesizeOnline({ text, seed }, { deadline: deadline() });
    let chunks = 0;
    let streamed = 0;
    call.on("data", (message) => { chunks += 1; streamed += message.audio.length; });
    call.on("error", fail);
    call.on("end", () => {
      console.log(JSON.stringify({
        voices: voices.voices.map((v) => v.name), default_voice: voices.default_voice,
        audio_bytes: whole.audio.length, frames: whole.usage.frames,
        finish_reason: whole.finish_reason, seed: whole.usage.seed, chunks, streamed_bytes: streamed,
      }));
      client.close();
    });
  });
});
