// loom-schedule: draws a pipeline schedule of loom/pipeline/schedule.hpp as text (one row per stage, one cell per
// unit of time) and, with --svg, as an SVG timeline; prints its verification, activation peaks and bubble.
//   loom-schedule --schedule 1f1b --pp 4 --micro-batches 8 [--chunks 2] [--group G] [--costs 1,1,1] [--svg out.svg]
//                 [--list]
#include <loom/pipeline/schedule.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

namespace {

namespace pl = loom::pipeline;
using loom::Schedule;

struct Options {
  Schedule schedule = Schedule::one_f_one_b;
  int pp = 4;
  int micro_batches = 8;
  std::optional<int> chunks;
  int group = 0;
  pl::Costs costs;
  std::string svg;
  bool list = false;
};

void usage(std::FILE* to) {
  std::fprintf(to,
               "usage: loom-schedule --schedule gpipe|1f1b|interleaved|zb-h1|zb-v --pp P --micro-batches M\n"
               "                     [--chunks V] [--group G] [--costs F,B,W] [--svg FILE] [--list]\n"
               "  --chunks V     model chunks per stage (interleaved: default 2; zb-v always has 2)\n"
               "  --group G      interleaved: micro-batches a chunk runs in a row (default: the stage count,\n"
               "                 Megatron-LM's order; Llama 3's schedule lets it differ)\n"
               "  --costs F,B,W  compute cost of a forward, input-gradient and weight-gradient action (default\n"
               "                 1,1,1; a full backward BW costs B+W); exchanges take no time\n"
               "  --svg FILE     also write the timeline as SVG\n"
               "  --list         print each stage's actions, sends and receives included, in issue order\n");
}

std::optional<Schedule> parse_schedule(std::string_view s) {
  for (Schedule x : {Schedule::gpipe, Schedule::one_f_one_b, Schedule::interleaved, Schedule::zero_bubble_h1,
                     Schedule::zero_bubble_v})
    if (loom::describe_schedule(x) == s) return x;
  return std::nullopt;
}

int parse_int(const char* flag, const char* v) {
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  if (end == v || *end != '\0') throw loom::Error(std::string("loom: ") + flag + " takes a whole number, got " + v);
  return static_cast<int>(x);
}

pl::Costs parse_costs(const char* v) {
  pl::Costs c;
  char comma1 = 0, comma2 = 0;
  std::istringstream in(v);
  if (!(in >> c.f >> comma1 >> c.b >> comma2 >> c.w) || comma1 != ',' || comma2 != ',' || c.f <= 0 || c.b <= 0 ||
      c.w <= 0)
    throw loom::Error(std::string("loom: --costs takes three positive numbers F,B,W, got ") + v);
  return c;
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    auto value = [&]() -> const char* {
      if (i + 1 >= argc) throw loom::Error("loom: " + std::string(a) + " needs a value");
      return argv[++i];
    };
    if (a == "--schedule") {
      const char* v = value();
      const auto s = parse_schedule(v);
      if (!s) throw loom::Error(std::string("loom: unknown schedule ") + v + " (gpipe, 1f1b, interleaved, zb-h1, zb-v)");
      o.schedule = *s;
    } else if (a == "--pp") {
      o.pp = parse_int("--pp", value());
    } else if (a == "--micro-batches") {
      o.micro_batches = parse_int("--micro-batches", value());
    } else if (a == "--chunks") {
      o.chunks = parse_int("--chunks", value());
    } else if (a == "--group") {
      o.group = parse_int("--group", value());
    } else if (a == "--costs") {
      o.costs = parse_costs(value());
    } else if (a == "--svg") {
      o.svg = value();
    } else if (a == "--list") {
      o.list = true;
    } else if (a == "--help" || a == "-h") {
      usage(stdout);
      std::exit(0);
    } else {
      throw loom::Error("loom: unknown option " + std::string(a));
    }
  }
  return o;
}

// "F3", "B3" (BW is drawn as the backward it is), "W3"; with several chunks a letter names the chunk: "F3a", "F3b".
std::string label(const pl::Action& a, int chunks) {
  std::string s = a.kind == pl::Kind::F ? "F" : a.kind == pl::Kind::W ? "W" : "B";
  s += std::to_string(a.micro);
  if (chunks > 1) s += static_cast<char>('a' + a.chunk);
  return s;
}

std::string number(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", x);
  return buf;
}

void print_grid(const pl::RuntimeTable& t, const pl::RuntimeTimeline& tl) {
  const int P = t.stage_count();
  const int cells = static_cast<int>(std::ceil(tl.makespan - 1e-9));
  std::size_t width = 2;
  for (int s = 0; s < P; ++s)
    for (const pl::Action& a : t.stage(s)) width = std::max(width, label(a, t.chunks).size() + 1);
  std::vector<std::vector<std::string>> rows(static_cast<std::size_t>(P),
                                             std::vector<std::string>(static_cast<std::size_t>(cells), "."));
  for (int s = 0; s < P; ++s) {
    const auto list = t.stage(s);
    for (std::size_t i = 0; i < list.size(); ++i) {
      if (!pl::is_compute(list[i].kind)) continue;
      const pl::Slot slot = tl.stage(s)[i];
      // A cell shows what runs in the middle of its unit of time.
      for (int c = 0; c < cells; ++c)
        if (c + 0.5 > slot.start && c + 0.5 < slot.end)
          rows[static_cast<std::size_t>(s)][static_cast<std::size_t>(c)] = label(list[i], t.chunks);
    }
  }
  std::string head = "time     ";
  for (int c = 0; c < cells; ++c) {
    std::string cell = c % 5 == 0 ? std::to_string(c) : "";
    cell.resize(width, ' ');
    head += cell;
  }
  std::printf("%s\n", head.c_str());
  for (int s = 0; s < P; ++s) {
    std::string line = "stage " + std::to_string(s);
    line.resize(9, ' ');
    for (const std::string& cell : rows[static_cast<std::size_t>(s)]) {
      std::string c = cell;
      c.resize(width, ' ');
      line += c;
    }
    while (!line.empty() && line.back() == ' ') line.pop_back();
    std::printf("%s\n", line.c_str());
  }
}

void print_lists(const pl::RuntimeTable& t) {
  for (int s = 0; s < t.stage_count(); ++s) {
    std::printf("stage %d:", s);
    bool in_batch = false;
    for (const pl::Action& a : t.stage(s)) {
      const bool exchange = !pl::is_compute(a.kind);
      if (exchange && !in_batch) std::printf(" [");
      if (!exchange && in_batch) std::printf(" ]");
      in_batch = exchange;
      if (exchange)
        std::printf(" %s(%d%s %s %d)", std::string(pl::describe(a.kind)).c_str(), a.micro,
                    t.chunks > 1 ? std::string(1, static_cast<char>('a' + a.chunk)).c_str() : "",
                    pl::is_send(a.kind) ? "to" : "from", a.peer);
      else
        std::printf(" %s", label(a, t.chunks).c_str());
    }
    if (in_batch) std::printf(" ]");
    std::printf("\n");
  }
}

// Fill colour per kind, lighter for later chunks.
std::string colour(pl::Kind k, int chunk, int chunks) {
  int r = 0x4c, g = 0x78, b = 0xc8;                                      // F
  if (k == pl::Kind::B || k == pl::Kind::BW) r = 0x3a, g = 0xa8, b = 0x6b;  // backward, input gradient
  if (k == pl::Kind::W) r = 0xe8, g = 0xa0, b = 0x2a;                      // weight gradient
  const double mix = chunks > 1 ? 0.55 * chunk / (chunks - 1) : 0.0;
  auto lift = [&](int x) { return static_cast<int>(x + (255 - x) * mix); };
  char buf[8];
  std::snprintf(buf, sizeof buf, "#%02x%02x%02x", lift(r), lift(g), lift(b));
  return buf;
}

void write_svg(const std::string& path, const pl::RuntimeTable& t, const pl::RuntimeTimeline& tl,
               const std::string& title) {
  const int P = t.stage_count();
  const double unit = std::clamp(1200.0 / tl.makespan, 6.0, 28.0);
  const double left = 64, top = 34, row = 26, gap = 6;
  const double width = left + tl.makespan * unit + 16;
  const double height = top + P * (row + gap) + 58;
  std::ofstream out(path);
  if (!out) throw loom::Error("loom: cannot write " + path);
  out << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << width << "\" height=\"" << height
      << "\" font-family=\"Helvetica, Arial, sans-serif\" font-size=\"11\">\n";
  out << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  out << "<text x=\"" << left << "\" y=\"20\" font-size=\"13\">" << title << "</text>\n";
  for (int s = 0; s < P; ++s) {
    const double y = top + s * (row + gap);
    out << "<text x=\"8\" y=\"" << y + row / 2 + 4 << "\">stage " << s << "</text>\n";
    out << "<rect x=\"" << left << "\" y=\"" << y << "\" width=\"" << tl.makespan * unit << "\" height=\"" << row
        << "\" fill=\"#f2f2f2\"/>\n";
    const auto list = t.stage(s);
    for (std::size_t i = 0; i < list.size(); ++i) {
      const pl::Action& a = list[i];
      if (!pl::is_compute(a.kind)) continue;
      const pl::Slot slot = tl.stage(s)[i];
      const double x = left + slot.start * unit, w = (slot.end - slot.start) * unit;
      out << "<rect x=\"" << x << "\" y=\"" << y << "\" width=\"" << w << "\" height=\"" << row << "\" fill=\""
          << colour(a.kind, a.chunk, t.chunks) << "\" stroke=\"white\" stroke-width=\"1\"><title>"
          << pl::describe(a.kind) << " micro-batch " << a.micro << ", chunk " << a.chunk << ": " << slot.start
          << " to " << slot.end << "</title></rect>\n";
      if (w >= 11)
        out << "<text x=\"" << x + w / 2 << "\" y=\"" << y + row / 2 + 4 << "\" text-anchor=\"middle\" fill=\""
            << (a.chunk == 0 || t.chunks == 1 ? "white" : "#222") << "\">" << a.micro << "</text>\n";
    }
  }
  const double axis = top + P * (row + gap);
  const int step = tl.makespan > 60 ? 10 : 5;
  for (int c = 0; c <= static_cast<int>(tl.makespan); c += step)
    out << "<text x=\"" << left + c * unit << "\" y=\"" << axis + 8 << "\" text-anchor=\"middle\" fill=\"#666\">" << c
        << "</text>\n";
  double lx = left;
  const double ly = axis + 24;
  auto key = [&](const std::string& fill, const std::string& text) {
    out << "<rect x=\"" << lx << "\" y=\"" << ly << "\" width=\"14\" height=\"14\" fill=\"" << fill << "\"/>\n";
    out << "<text x=\"" << lx + 19 << "\" y=\"" << ly + 11 << "\">" << text << "</text>\n";
    lx += 30 + 6.5 * static_cast<double>(text.size());
  };
  bool split = false;
  for (int s = 0; s < P; ++s)
    for (const pl::Action& a : t.stage(s)) split = split || a.kind == pl::Kind::W;
  key(colour(pl::Kind::F, 0, 1), "F forward");
  key(colour(pl::Kind::B, 0, 1), split ? "B input gradient" : "B backward (input and weight gradient)");
  if (split) key(colour(pl::Kind::W, 0, 1), "W weight gradient");
  if (t.chunks > 1) key(colour(pl::Kind::F, t.chunks - 1, t.chunks), "lighter: later chunk");
  out << "</svg>\n";
}

int run(const Options& o) {
  const int v = o.chunks.value_or(o.schedule == Schedule::interleaved ? 2 : 1);
  const pl::RuntimeTable t = pl::make_schedule_checked(o.schedule, o.pp, o.micro_batches, v, o.group);
  const pl::VerifyResult r = pl::verify(t, o.costs);
  const pl::RuntimeTimeline tl = pl::simulate(t, o.costs);
  const std::string name(loom::describe_schedule(o.schedule));
  const int P = t.stage_count();

  std::printf("%s: p = %d stages, m = %d micro-batches, v = %d chunk%s per stage; costs F %s, B %s, W %s (BW %s)\n",
              name.c_str(), P, t.micro_batches, t.chunks, t.chunks > 1 ? "s" : "", number(o.costs.f).c_str(),
              number(o.costs.b).c_str(), number(o.costs.w).c_str(), number(o.costs.b + o.costs.w).c_str());
  if (t.group > 0) std::printf("each chunk runs the micro-batches in groups of %d\n", t.group);
  if (t.chunks > 1) {
    std::printf("chunk letters: a = chunk 0, b = chunk 1, ...; stage s chunk c holds model part");
    for (int s = 0; s < P; ++s) {
      std::printf(s ? "," : "");
      for (int c = 0; c < t.chunks; ++c)
        std::printf(" %d%c=%d", s, 'a' + c, pl::virtual_stage(o.schedule, P, s, c));
    }
    std::printf("\n");
  }
  print_grid(t, tl);
  if (o.list) print_lists(t);

  std::printf("verified: every send meets its receive in order, no deadlock, each micro-batch runs F then B and W "
              "(or BW) once on every model part\n");
  std::printf("peak in-flight activations per stage:");
  for (int s = 0; s < P; ++s) std::printf(" %d", r.peak_in_flight[static_cast<std::size_t>(s)]);
  std::printf(" (bound");
  for (int s = 0; s < P; ++s)
    std::printf(" %d", pl::activation_bound(o.schedule, P, t.micro_batches, t.chunks, s, t.group));
  std::printf(")\n");
  double busy = 0;
  for (double b : tl.busy) busy += b;
  std::printf("makespan %s units, compute %s units per stage, idle %s units per stage\n", number(tl.makespan).c_str(),
              number(busy / P).c_str(), number(tl.makespan - busy / P).c_str());
  std::printf("bubble %.4f of the step, %.4f of the ideal\n", tl.bubble, tl.bubble_ratio);

  if (!o.svg.empty()) {
    char title[200];
    std::snprintf(title, sizeof title, "%s, p = %d, m = %d%s: bubble %.1f%% of the step", name.c_str(), P,
                  t.micro_batches, t.chunks > 1 ? (", v = " + std::to_string(t.chunks)).c_str() : "",
                  100 * tl.bubble);
    write_svg(o.svg, t, tl, title);
    std::printf("wrote %s\n", o.svg.c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  try {
    o = parse(argc, argv);
  } catch (const loom::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    usage(stderr);
    return 2;
  }
  try {
    return run(o);
  } catch (const loom::Error& e) {  // counts that do not fit the schedule, or an unwritable --svg path
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  }
}
