#include "m3attn/config.h"

#include <cmath>
#include <sstream>

namespace m3attn {

Status MsaGeometry::validate() const {
  M3_CHECK_ARG(hidden > 0 && hidden % kQuantBlock == 0, "hidden size ", hidden,
               " must be a positive multiple of ", kQuantBlock);
  M3_CHECK_ARG(n_q > 0, "query head count must be > 0, got ", n_q);
  M3_CHECK_ARG(n_kv > 0, "KV head count must be > 0, got ", n_kv);
  M3_CHECK_ARG(n_q % n_kv == 0, "query heads ", n_q, " must be a multiple of KV heads ", n_kv);
  M3_CHECK_ARG(std::isfinite(eps) && eps > 0, "RMSNorm eps must be finite and > 0, got ", eps);
  M3_CHECK_ARG(std::isfinite(rope_theta) && rope_theta > 0,
               "rope theta must be finite and > 0, got ", rope_theta);
  return Status::Ok();
}

std::string MsaGeometry::to_string() const {
  std::ostringstream os;
  os << "hidden " << hidden << ", q heads " << n_q << ", kv heads " << n_kv << ", packed width "
     << packed_width();
  return os.str();
}

Result<MsaGeometry> MsaGeometry::m3_tp(int tp_size) {
  if (tp_size != 1 && tp_size != 2 && tp_size != 4 && tp_size != 8)
    return unsupported("tensor-parallel size ", tp_size, " is not one of 1, 2, 4, 8");
  MsaGeometry g;
  g.n_q = 64 / tp_size;
  g.n_kv = tp_size <= 4 ? 4 / tp_size : 1;
  return g;
}

}  // namespace m3attn
